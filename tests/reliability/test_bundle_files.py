"""A bundle file that is not a regular file (issue 50, item 6): a FIFO in place of native.bin blocked `--no-verify`
forever. Every file the runtime reads (the manifest, the tokenizer's files, the ONNX graph and its data, the native
weights) is refused when it is a FIFO, a directory, a socket or a device, with or without the hash checks, before it
is opened for reading; `auto` runs onnxruntime when only native.bin is refused. Each call runs in a thread with a
deadline: a reader that blocks fails the test (its FIFO then gets a writer, which lets it go) instead of hanging.
And a model file padded to 4 GiB is refused from its recorded size before the hash reads it (issue 50, item 4)."""
from __future__ import annotations

import json
import os
import re
import shutil
import socket
import stat
import threading
from pathlib import Path

import pytest

import specdec
from specdec.cli import main
from specdec.errors import ManifestError
from specdec.files import check_regular, read_regular

DEADLINE = 120  # seconds: a call that has not returned by then is blocked
GENERATE = ["--prompt", "The quick", "--max-new-tokens", "2"]
WHAT = {"fifo": "a FIFO (named pipe)", "directory": "a directory", "socket": "a socket",
        "device": "a character device"}


def _replace(path: Path, kind: str) -> None:
    """`path`'s file replaced by a node of `kind`."""
    path.unlink()
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "directory":
        path.mkdir()
    elif kind == "socket":
        if len(str(path)) > 100:
            pytest.skip("the path is too long for a unix socket")
        server = socket.socket(socket.AF_UNIX)
        server.bind(str(path))  # bound, never listening: a file of type socket
    else:
        try:
            os.mknod(path, stat.S_IFCHR | 0o600, os.makedev(1, 5))  # /dev/zero's numbers: endless zeros
        except PermissionError:
            pytest.skip("making a device node needs root")


def _within_deadline(call, fifo: Path | None = None):
    """call()'s result, or its exception raised here; fails where it blocks past DEADLINE."""
    outcome = {}

    def run():
        try:
            outcome["value"] = call()
        except BaseException as exc:  # noqa: BLE001 - handed to the test's thread
            outcome["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(DEADLINE)
    if thread.is_alive():
        if fifo is not None and stat.S_ISFIFO(os.stat(fifo).st_mode):
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))  # a writer that leaves: the reader sees its end
        pytest.fail(f"the call blocked on {fifo}")
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


@pytest.fixture(scope="module")
def native_bundle(tmp_path_factory, export_tiny):
    """A tiny LLaMA (head size 16: the packed gqa graph the native engine reads) with native weights, no draft."""
    from specdec.export.tiny import save_tiny

    model = save_tiny(tmp_path_factory.mktemp("llama64"), "llama", seed=0, init_range=0.5, hidden=64)
    return export_tiny(tmp_path_factory.mktemp("b") / "native", model, lowering="gqa", no_draft=True)


@pytest.fixture
def bundle(native_bundle, tmp_path):
    copy = tmp_path / "b"
    shutil.copytree(native_bundle, copy)
    assert (copy / "target" / "native.bin").is_file()
    return copy


def _open(bundle, backend: str, verify: bool):
    return _within_deadline(lambda: specdec.load(bundle, backend=backend, verify=verify).close(),
                            next((p for p in bundle.rglob("*") if stat.S_ISFIFO(os.lstat(p).st_mode)), None))


@pytest.mark.parametrize("verify", [True, False])
@pytest.mark.parametrize("rel,backend", [("manifest.json", "onnxruntime"), ("tokenizer.json", "onnxruntime"),
                                         ("tokenizer_config.json", "onnxruntime"),
                                         ("chat_template.jinja", "onnxruntime"), ("target/model.onnx", "onnxruntime"),
                                         ("target/model.onnx.data", "onnxruntime"), ("target/native.bin", "native")])
def test_a_fifo_in_place_of_any_bundle_file_is_refused(bundle, rel, backend, verify):
    _replace(bundle / rel, "fifo")
    with pytest.raises(ManifestError, match=f"{rel}' is a FIFO \\(named pipe\\), not a regular file") as caught:
        _open(bundle, backend, verify)
    assert "regular files" in caught.value.hint


@pytest.mark.parametrize("verify", [True, False])
@pytest.mark.parametrize("kind", ["fifo", "directory", "socket", "device"])
def test_native_weights_that_are_not_a_file_are_refused_and_auto_runs_onnxruntime(bundle, kind, verify):
    _replace(bundle / "target" / "native.bin", kind)
    with pytest.raises(ManifestError, match=re.escape(f"native.bin' is {WHAT[kind]}, not a regular file")):
        _open(bundle, "native", verify)
    with _within_deadline(lambda: specdec.load(bundle, verify=verify)) as gen:
        assert gen.backend == "onnxruntime" and f"is {WHAT[kind]}" in gen.backend_note


@pytest.mark.parametrize("kind", ["directory", "socket", "device"])
def test_a_tokenizer_that_is_not_a_file_is_refused(bundle, kind):
    _replace(bundle / "tokenizer.json", kind)
    for verify in (True, False):
        with pytest.raises(ManifestError, match=re.escape(f"tokenizer.json' is {WHAT[kind]}, not a regular file")):
            _open(bundle, "onnxruntime", verify)


def test_generate_with_no_verify_on_a_fifo_is_a_message(bundle, capsys):
    _replace(bundle / "target" / "native.bin", "fifo")
    code = _within_deadline(lambda: main(["generate", str(bundle), "--no-verify", "--backend", "native", *GENERATE]),
                            bundle / "target" / "native.bin")
    err = capsys.readouterr().err
    assert code == 1 and "is a FIFO (named pipe), not a regular file" in err and "Hint:" in err
    assert "Traceback" not in err


def test_a_swap_after_the_check_is_seen_on_the_open_file(tmp_path, monkeypatch):
    """The check stats the path, opens it without blocking, and checks the open file again: a FIFO swapped in
    between (here: at the open) is refused without a read."""
    path = tmp_path / "f"
    path.write_bytes(b"data")
    assert read_regular(path) == b"data"
    real_open = os.open

    def swapping_open(name, flags, *args):
        if Path(name) == path:
            path.unlink()
            os.mkfifo(path)
        return real_open(name, flags, *args)

    monkeypatch.setattr(os, "open", swapping_open)
    with pytest.raises(ManifestError, match="is a FIFO"):
        _within_deadline(lambda: check_regular(path), path)


def _read_bytes() -> int:
    """Bytes this process has read through read(2) and its kin (Linux's /proc/self/io rchar)."""
    for line in open("/proc/self/io", encoding="ascii"):
        if line.startswith("rchar:"):
            return int(line.split()[1])
    raise AssertionError("no rchar in /proc/self/io")


@pytest.mark.skipif(not os.path.exists("/proc/self/io"), reason="reads /proc/self/io")
def test_a_padded_graph_file_is_refused_before_it_is_hashed(bundle):
    """The manifest records each model file's size beside its sha256: 4 GiB of zeros after the graph's data (a
    sparse file) is refused from its size, never read whole by the hash. onnxruntime itself reads only the ranges the
    graph names, so without the hash checks the padding costs nothing. A bundle written before sizes were recorded
    still opens, and a size that is no byte count is refused with the manifest."""
    path = bundle / "target" / "model.onnx.data"
    size = path.stat().st_size
    os.truncate(path, 4 << 30)
    before = _read_bytes()
    with pytest.raises(ManifestError, match=f"model.onnx.data' has {4 << 30} bytes, the manifest records {size}"):
        specdec.load(bundle, backend="onnxruntime")
    assert _read_bytes() - before < 64 << 20
    specdec.load(bundle, backend="onnxruntime", verify=False).close()
    os.truncate(path, size)
    manifest = json.loads((bundle / "manifest.json").read_text())
    assert manifest["models"]["target"]["sizes"]["target/model.onnx.data"] == size
    manifest["models"]["target"]["sizes"] = {}
    (bundle / "manifest.json").write_text(json.dumps(manifest))
    specdec.load(bundle, backend="onnxruntime").close()
    manifest["models"]["target"]["sizes"] = {"target/model.onnx.data": -1}
    (bundle / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ManifestError, match="models.target.sizes gives 'target/model.onnx.data' -1, not a byte count"):
        specdec.load(bundle, backend="onnxruntime")
