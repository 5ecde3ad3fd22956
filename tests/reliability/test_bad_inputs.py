"""The bad-input table: each case runs the CLI (in process, or as a subprocess where the shell matters) and checks
the exit code, the message, the `Hint:`, that no traceback is printed, and that nothing on disk changed or was left
behind (a snapshot of the working folder before and after)."""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from specdec.cli import export_main, main

EXPORT = ["--max-seq-len", "64", "--gamma", "2", "--gamma-max", "4", "--max-prefill-chunk", "16", "--skip-parity"]


def snapshot(root: Path) -> dict:
    """Every file and folder under root -> sha256 (files) or 'dir'."""
    state = {}
    for path in sorted(root.rglob("*")):
        rel = str(path.relative_to(root))
        state[rel] = "dir" if path.is_dir() else hashlib.sha256(path.read_bytes()).hexdigest()
    return state


def check_refused(capsys, root: Path, entry, argv: list, message: str, code: int = 1) -> str:
    before = snapshot(root)
    assert entry(argv) == code
    err = capsys.readouterr().err
    assert message in err, err
    assert "Hint:" in err and "Traceback" not in err, err
    assert snapshot(root) == before, "the refused command changed or left files"
    return err


@pytest.fixture
def work(tmp_path, tiny_llama, int4_bundle, monkeypatch):
    """A working folder with a model, a bundle and a folder of someone's notes; the test runs inside it."""
    shutil.copytree(tiny_llama, tmp_path / "model")
    shutil.copytree(int4_bundle, tmp_path / "bundle")
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "thesis.txt").write_text("four years of work\n")
    monkeypatch.chdir(tmp_path)
    return tmp_path


def _edit_manifest(root: Path, edit) -> None:
    path = root / "bundle" / "manifest.json"
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data))


EXPORT_CASES = {  # name: (argv, message)
    "overwrite a folder that is not a bundle": (["--target", "model", "--out", "notes", "--overwrite"],
                                                "not a specdec bundle"),
    "out is the source model": (["--target", "model", "--out", "model", "--overwrite"], "is the source"),
    "out inside the source": (["--target", "model", "--out", "model/sub"], "is inside the source"),
    "out is the current directory": (["--target", "model", "--out", ".", "--overwrite"], "current directory"),
    "out is the root": (["--target", "model", "--out", "/", "--overwrite"], "root directory"),
    "out exists without --overwrite": (["--target", "model", "--out", "bundle"], "already exists"),
    "out is a file": (["--target", "model", "--out", "notes/thesis.txt", "--overwrite"], "not a directory"),
    "missing model": (["--target", "./nowhere", "--out", "o"], "does not exist"),
    "gamma above gamma-max": (["--target", "model", "--out", "o", "--gamma", "9", "--gamma-max", "8"], "--gamma 9"),
    "zero max-seq-len": (["--target", "model", "--out", "o", "--max-seq-len", "0"], "positive integer"),
    "engine without tensorrt": (["--target", "model", "--out", "o", "--engine", "tensorrt"], "'tensorrt'"),
    "quantize an fp16 export": (["--target", "model", "--out", "o", "--quantize", "int4-rtn", "--dtype", "fp16"],
                                "--dtype fp16"),
    "calibration options alone": (["--target", "model", "--out", "o", "--calibration-samples", "4"],
                                  "without --quantize"),
}


@pytest.mark.parametrize("case", list(EXPORT_CASES))
def test_export_refuses(case, work, capsys):
    argv, message = EXPORT_CASES[case]
    check_refused(capsys, work, export_main, EXPORT + argv, message)
    assert (work / "notes" / "thesis.txt").read_text() == "four years of work\n"


def test_export_with_the_source_inside_out(work, capsys):
    (work / "models").mkdir()
    shutil.move(work / "model", work / "models" / "m")
    shutil.copytree(work / "bundle", work / "models" / "old")  # --out holds a bundle, and the source too
    shutil.copy(work / "bundle" / "manifest.json", work / "models" / "manifest.json")
    check_refused(capsys, work, export_main, ["--target", "models/m", "--out", "models", "--overwrite"] + EXPORT,
                  "contains the source")


@pytest.mark.parametrize("damage, message", [("truncate", "truncated or corrupt"), ("delete", "cannot load the weights")])
def test_export_from_damaged_weights(work, capsys, damage, message):
    weights = work / "model" / "model.safetensors"
    if damage == "truncate":
        weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    else:
        weights.unlink()
    check_refused(capsys, work, export_main, ["--target", "model", "--out", "o"] + EXPORT, message)


GENERATE_CASES = {  # name: (extra argv, message)
    "temperature nan": (["--temperature", "nan"], "finite number"),
    "temperature inf": (["--temperature", "inf"], "finite number"),
    "negative temperature": (["--temperature", "-1"], "temperature must be >= 0"),
    "negative seed": (["--seed", "-1"], "seed must be an integer >= 0"),
    "top-p above one": (["--top-p", "1.5"], "top_p must be in (0, 1]"),
    "negative top-k": (["--top-k", "-1"], "top_k must be an integer >= 0"),
    "zero max-new-tokens": (["--max-new-tokens", "0"], "max_new_tokens must be an integer >= 1"),
    "zero gamma": (["--gamma", "0"], "gamma must be an integer >= 1"),
    "gamma above the bundle's": (["--gamma", "99"], "gamma_max"),
    "empty stop string": (["--stop", ""], "non-empty"),
    "lone surrogate in the prompt": (["--prompt", "caf\udce9"], "not valid Unicode"),
}


@pytest.mark.parametrize("case", list(GENERATE_CASES))
def test_generate_refuses(case, work, capsys):
    extra, message = GENERATE_CASES[case]
    prompt = [] if "--prompt" in extra else ["--prompt", "The quick"]
    check_refused(capsys, work, main, ["generate", "bundle", *prompt, "--max-new-tokens", "4", *extra], message)


MANIFEST_CASES = {  # name: (edit, message)
    "a field of the wrong type": (lambda m: m["models"]["target"].update(max_seq_len="96"), "expected int"),
    "a missing field": (lambda m: m["models"]["target"].pop("dims"), "models.target.dims is missing"),
    "a path outside the bundle": (lambda m: m["models"]["target"]["files"].update({"../../etc/passwd": "0" * 64}),
                                  "outside the bundle"),
    "an absolute path": (lambda m: m["models"]["target"].update(onnx_path="/etc/passwd"), "outside the bundle"),
    "S that disagrees with the graph": (lambda m: [e.update(max_seq_len=80) for e in m["models"].values()],
                                        "does not match its graph"),
    "an unknown lowering": (lambda m: m["models"]["target"].update(lowering="fused"), "lowering 'fused' is unknown"),
}


@pytest.mark.parametrize("case", list(MANIFEST_CASES))
def test_a_damaged_manifest_is_refused(case, work, capsys):
    edit, message = MANIFEST_CASES[case]
    _edit_manifest(work, edit)
    check_refused(capsys, work, main, ["generate", "bundle", "--prompt", "The quick", "--max-new-tokens", "4"], message)


def test_bundle_paths(work, capsys):
    check_refused(capsys, work, main, ["inspect", "bundle/manifest.json"], "is a file, not a bundle directory")
    check_refused(capsys, work, main, ["inspect", "missing"], "does not exist")
    check_refused(capsys, work, main, ["generate", "notes", "--prompt", "x"], "not a specdec bundle")
    (work / "bundle" / "target" / "model.onnx").write_bytes(b"edited")
    check_refused(capsys, work, main, ["inspect", "bundle"], "sha256")


def test_a_model_drafter_needs_a_draft(work, capsys):
    _edit_manifest(work, lambda m: m["models"].pop("draft"))
    check_refused(capsys, work, main, ["generate", "bundle", "--prompt", "x", "--drafter", "model"], "no draft model")


CALIBRATE_CASES = {
    "quantize into its own input": (["calibrate", "quantize", "bundle", "--method", "int4-rtn", "--out", "bundle",
                                     "--overwrite"], "is the source"),
    "quantize over the current directory": (["calibrate", "quantize", "bundle", "--method", "int4-rtn", "--out", ".",
                                             "--overwrite"], "current directory"),
    "quantize over notes": (["calibrate", "quantize", "bundle", "--method", "int4-rtn", "--out", "notes",
                             "--overwrite"], "not a specdec bundle"),
}


@pytest.mark.parametrize("case", list(CALIBRATE_CASES))
def test_calibrate_refuses(case, work, capsys):
    argv, message = CALIBRATE_CASES[case]
    check_refused(capsys, work, main, argv, message)


def test_calibrate_over_the_folder_holding_its_input(work, capsys):
    (work / "holder").mkdir()
    shutil.move(work / "bundle", work / "holder" / "b")
    shutil.copy(work / "holder" / "b" / "manifest.json", work / "holder" / "manifest.json")
    check_refused(capsys, work, main, ["calibrate", "quantize", "holder/b", "--method", "int4-rtn", "--out", "holder",
                                       "--overwrite"], "contains the source")


def _cli(args: list, cwd: Path, **env) -> subprocess.CompletedProcess:
    environment = dict(os.environ, PYTHONPATH=os.getcwd(), **env)
    return subprocess.run([sys.executable, "-m", "specdec.cli", *args], cwd=cwd, capture_output=True,
                          env=environment, timeout=120)


def test_a_closed_pipe_is_not_a_traceback(work):
    shell = f"{sys.executable} -m specdec.cli generate bundle --prompt 'The quick' --max-new-tokens 40 | head -c 5"
    proc = subprocess.run(["bash", "-o", "pipefail", "-c", shell], cwd=work, capture_output=True, timeout=120,
                          env=dict(os.environ, PYTHONPATH=os.getcwd()))
    err = proc.stderr.decode()
    assert len(proc.stdout) <= 5 and "Traceback" not in err and "Exception ignored" not in err, err


def test_an_ascii_only_terminal_gets_escapes_not_a_traceback(work):
    proc = _cli(["generate", "bundle", "--prompt", "The quick", "--max-new-tokens", "24"], work,
                PYTHONIOENCODING="ascii")
    assert proc.returncode == 0, proc.stderr.decode()
    assert b"Traceback" not in proc.stderr
    proc.stdout.decode("ascii")  # everything printed is ASCII


def test_argv_that_is_not_utf8(work):
    proc = subprocess.run([sys.executable, "-m", "specdec.cli", "generate", "bundle", "--prompt", b"caf\xe9"],
                          cwd=work, capture_output=True, timeout=120, env=dict(os.environ, PYTHONPATH=os.getcwd()))
    assert proc.returncode == 1 and b"not valid Unicode" in proc.stderr and b"Hint:" in proc.stderr
    assert b"Traceback" not in proc.stderr
