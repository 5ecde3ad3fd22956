"""Bundles carry data, not code, and no command deletes what is not a bundle: --overwrite, chat templates, weights
and parity figures that are not finite, calibration data, a manifest's defaults or one its graph contradicts, cut or
linked files, `calibrate report`'s outputs and `specdec bench` on a base model. Each case runs the real CLI or API on
the tiny bundles and checks the message, the `Hint:`, that no traceback is printed, and that the files on disk are as
they were."""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import shutil
from pathlib import Path

import jinja2
import pytest

import specdec
from specdec import GenerationConfig
from specdec.chat_template import compile_chat_template, render_chat
from specdec.cli import export_main, main
from specdec.errors import ConfigError, ExportError, ManifestError
from specdec.export.parity import enforce_parity
from specdec.export.tiny import CHAT_TEMPLATE, tiny_tokenizer
from specdec.manifest import ParityStep, read_manifest, sampling_problem, sha256_file
from specdec.publish import check_destination, staged_bundle
from specdec.runtime.text import TextCodec

EXPORT = ["--max-seq-len", "64", "--gamma", "2", "--gamma-max", "4", "--max-prefill-chunk", "16"]
GENERATE = ["--prompt", "The quick", "--max-new-tokens", "4"]
PROMPTS = Path(__file__).resolve().parents[2] / "benchmarks" / "prompts"
EVIL = "{{ cycler.__init__.__globals__.os.system('touch %s') }}"


def snapshot(root: Path) -> dict:
    """Every file and folder under root (links not followed) -> sha256, 'dir' or 'link'."""
    state = {}
    for path in sorted(root.rglob("*")):
        kind = "link" if path.is_symlink() else "dir" if path.is_dir() else hashlib.sha256(path.read_bytes()).hexdigest()
        state[str(path.relative_to(root))] = kind
    return state


def refused(capsys, entry, argv: list, message: str, root: Path) -> str:
    """Run a CLI entry point: exit 1, `message` and a hint on stderr, no traceback, nothing under root changed."""
    before = snapshot(root)
    assert entry(argv) == 1
    err = capsys.readouterr().err
    assert message in err and "Hint:" in err and "Traceback" not in err, err
    assert snapshot(root) == before, "the refused command changed or left files"
    return err


def edit_manifest(bundle: Path, edit) -> None:
    path = bundle / "manifest.json"
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data))


def rehash(bundle: Path, rel: str) -> None:
    """Record a changed tokenizer file's sha256, as a deliberately made bundle would."""
    edit_manifest(bundle, lambda m: m["tokenizer"]["files"].update({rel: sha256_file(bundle / rel)}))


@pytest.fixture
def work(tmp_path, tiny_llama, int4_bundle, monkeypatch):
    """A working folder with a model and a bundle (plain lowering); the test runs inside it."""
    shutil.copytree(tiny_llama, tmp_path / "model")
    shutil.copytree(int4_bundle, tmp_path / "bundle")
    monkeypatch.chdir(tmp_path)
    return tmp_path


# --overwrite replaces only a specdec bundle.
def _web_app(folder: Path, bundle: Path) -> None:
    (folder / "manifest.json").write_text('{"name": "My PWA"}')


def _other_schema(folder: Path, bundle: Path) -> None:
    shutil.copytree(bundle, folder, dirs_exist_ok=True)
    edit_manifest(folder, lambda m: m.update(schema_version=2))


def _files_missing(folder: Path, bundle: Path) -> None:
    shutil.copy(bundle / "manifest.json", folder / "manifest.json")


FOREIGN = {  # a folder holding a manifest.json that is not a complete specdec bundle: how to make it
    "a web app's manifest": _web_app,
    "another schema version": _other_schema,
    "a bundle's manifest without its files": _files_missing,
    "a manifest that is not UTF-8": lambda folder, bundle: (folder / "manifest.json").write_bytes(b'{"n": "\xff"}'),
    "a JSON list": lambda folder, bundle: (folder / "manifest.json").write_text("[1, 2]"),
    "JSON 100,000 levels deep": lambda folder, bundle: (folder / "manifest.json").write_text("[" * 100_000 + "]" * 100_000),
}


@pytest.mark.parametrize("case", list(FOREIGN))
def test_overwrite_spares_what_is_not_a_bundle(case, work):
    folder = work / "site"
    folder.mkdir()
    FOREIGN[case](folder, work / "bundle")
    (folder / "index.html").write_text("<html>my site</html>")
    before = snapshot(folder)
    with pytest.raises(ConfigError, match="--overwrite replaces only specdec bundles") as caught:
        check_destination(folder, overwrite=True)
    assert "nothing was deleted" in caught.value.hint
    assert snapshot(folder) == before


@pytest.mark.parametrize("command", ["export", "calibrate quantize"])
def test_overwrite_of_a_web_app_deletes_nothing(command, work, capsys):
    (work / "site").mkdir()
    _web_app(work / "site", work / "bundle")
    (work / "site" / "index.html").write_text("<html>my site</html>")
    if command == "export":
        argv, entry = ["--target", "model", "--out", "site", "--overwrite", *EXPORT, "--skip-parity"], export_main
    else:
        argv, entry = ["calibrate", "quantize", "bundle", "--method", "int4-rtn", "--out", "site", "--overwrite"], main
    refused(capsys, entry, argv, "not a specdec bundle", work)
    assert (work / "site" / "index.html").read_text() == "<html>my site</html>"


def test_overwrite_still_replaces_a_bundle(work):
    check_destination(work / "bundle", overwrite=True)
    with staged_bundle(work / "bundle") as tmp:
        (tmp / "new.txt").write_text("new")
    assert [p.name for p in (work / "bundle").iterdir()] == ["new.txt"]


def test_the_rule_is_checked_again_when_publishing(work):
    """A destination that stops being a bundle during the (long) export is not moved aside and deleted."""
    out = work / "bundle"
    check_destination(out, overwrite=True)
    with pytest.raises(ConfigError, match="nothing was deleted"):
        with staged_bundle(out) as tmp:
            (tmp / "new.txt").write_text("new")
            shutil.rmtree(out)
            out.mkdir()
            _web_app(out, out)
            (out / "index.html").write_text("<html>")
    assert (out / "index.html").read_text() == "<html>"
    assert sorted(p.name for p in work.iterdir()) == ["bundle", "model"]  # no staging directory left


# chat templates render in jinja2's immutable sandbox, at run time and at export.
@pytest.fixture
def evil_bundle(work):
    """A consistent bundle (its hashes match) whose chat template runs a shell command when rendered unsandboxed."""
    bundle, marker = work / "bundle", work / "PWNED"
    assert (bundle / "chat_template.jinja").is_file()
    (bundle / "chat_template.jinja").write_text(EVIL % marker)
    rehash(bundle, "chat_template.jinja")
    return bundle, marker


def test_a_bundle_template_runs_no_code(evil_bundle):
    bundle, marker = evil_bundle
    with specdec.load(bundle, backend="onnxruntime") as gen:
        with pytest.raises(ManifestError, match="refused by the sandbox"):
            gen.generate("hi", GenerationConfig(chat=True, max_new_tokens=2))
        with pytest.raises(jinja2.exceptions.SecurityError):  # the server renders codec.template itself
            gen.codec.template.render(messages=[{"role": "user", "content": "hi"}], add_generation_prompt=True)
        assert gen.generate("hi", GenerationConfig(max_new_tokens=2)).token_ids  # raw text still works
    assert not marker.exists()


def test_generate_chat_with_an_evil_template_is_a_message(evil_bundle, work, capsys):
    bundle, marker = evil_bundle
    refused(capsys, main, ["generate", "bundle", "--chat", "--backend", "onnxruntime", *GENERATE], "unsafe", work)
    assert not marker.exists()


def test_export_refuses_a_template_outside_the_sandbox(work, capsys):
    marker = work / "PWNED"
    assert (work / "model" / "chat_template.jinja").is_file()
    (work / "model" / "chat_template.jinja").write_text(EVIL % marker)
    refused(capsys, export_main, ["--target", "model", "--out", "o", *EXPORT, "--skip-parity"],
            "does not render in jinja2's sandbox", work)
    assert not marker.exists()


SMOLLM2 = ("{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\n"
           "You are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}{% endif %}"
           "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
           "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
CONVERSATIONS = [
    [{"role": "user", "content": "Hello!"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"},
     {"role": "assistant", "content": "4"}, {"role": "user", "content": "ünïcode <b>&</b>\n  spaced  "}],
]
SPECIAL = {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}


@pytest.mark.parametrize("template", [CHAT_TEMPLATE, SMOLLM2], ids=["tiny", "smollm2"])
def test_default_templates_render_as_before_and_as_transformers(template):
    unsandboxed = jinja2.Environment(trim_blocks=True, lstrip_blocks=True, keep_trailing_newline=True)
    tokenizer = tiny_tokenizer(320)
    tokenizer.chat_template = template
    for messages in CONVERSATIONS:
        for opened in (True, False):
            ours = render_chat(compile_chat_template(template), messages, SPECIAL, opened)
            assert ours == unsandboxed.from_string(template).render(messages=messages, add_generation_prompt=opened,
                                                                     **SPECIAL)
            assert ours == tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=opened)


def test_a_bundle_template_has_what_transformers_gives_one(work):
    """Loop controls, the generation tag, raise_exception, strftime_now and tojson, in a bundle's template."""
    template = ("{% for m in messages %}{% if m.role == 'tool' %}{{ raise_exception('no tools') }}{% endif %}"
                "{% generation %}{{ m.content | tojson }}{% endgeneration %}{% break %}{% endfor %}"
                "{{ strftime_now('%Y') | length }}")
    (work / "bundle" / "chat_template.jinja").write_text(template)
    codec = TextCodec(work / "bundle").open()
    assert codec.template.render(messages=[{"role": "user", "content": "<é>"}]) == '"<é>"4'
    with pytest.raises(ConfigError, match="refused the conversation: no tools"):
        codec.render_chat([{"role": "tool", "content": "x"}])


# NaN or inf is refused in weights and in parity figures.
@pytest.mark.parametrize("value", [math.nan, math.inf])
def test_export_refuses_weights_that_are_not_finite(work, capsys, value):
    from safetensors.torch import load_file, save_file

    path = work / "model" / "model.safetensors"
    weights = load_file(path)
    name = next(k for k in weights if k.endswith("down_proj.weight"))
    weights[name][0, 0] = value
    save_file(weights, path, metadata={"format": "pt"})
    refused(capsys, export_main, ["--target", "model", "--out", "o", *EXPORT], "NaN or inf", work)


@pytest.mark.parametrize("diff, tolerance, enforced", [(math.nan, 1.0, True), (math.nan, 1.0, False),
                                                       (math.inf, 1.0, True), (0.1, math.nan, True)])
def test_parity_figures_that_are_not_numbers_fail(diff, tolerance, enforced):
    with pytest.raises(ExportError, match="not a number"):
        enforce_parity("target", [ParityStep("prefill", 2, 12, 0, diff, tolerance, enforced)])


# calibration data that is not UTF-8, or not a parquet file, is a message.
def _parquet_cut(path: Path) -> None:
    import polars as pl

    pl.DataFrame({"text": ["a b c"] * 50}).write_parquet(path)
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _parquet_binary(path: Path) -> None:
    import polars as pl

    pl.DataFrame({"text": [b"caf\xe9", b"ok"]}).write_parquet(path)


DATA = {  # name: (file name, how to write it, message)
    "latin-1 text": ("cal.txt", lambda p: p.write_bytes(b"caf\xe9 au lait\n\nmore text"), "not UTF-8"),
    "latin-1 JSONL": ("cal.jsonl", lambda p: p.write_bytes(b'{"text": "caf\xe9"}\n'), "not UTF-8"),
    "random bytes": ("cal.parquet", lambda p: p.write_bytes(bytes(range(256)) * 4), "cannot be read as parquet"),
    "a parquet file cut in half": ("cal.parquet", _parquet_cut, "cannot be read as parquet"),
    "a column of bytes that are not UTF-8": ("cal.parquet", _parquet_binary, "cannot be read as parquet"),
}


@pytest.mark.parametrize("case", list(DATA))
def test_bad_calibration_data_is_a_message(case, work, capsys):
    if DATA[case][0].endswith(".parquet"):
        pytest.importorskip("polars")
    name, write, message = DATA[case]
    write(work / name)
    argv = ["--target", "model", "--out", "o", "--quantize", "int4-rtn", "--calibration-data", name, *EXPORT]
    refused(capsys, export_main, argv, message, work)


# a manifest's defaults meet the rules of a request's options; max_prefill_chunk >= 1.
BAD_DEFAULTS = {  # name: (defaults update, message)
    "negative temperature": ({"temperature": -1.0}, "temperature must be >= 0"),
    "infinite temperature": ({"temperature": math.inf}, "temperature must be a finite number"),
    "NaN temperature": ({"temperature": math.nan}, "temperature must be a finite number"),
    "top_p 0": ({"top_p": 0.0}, "top_p must be in (0, 1]"),
    "top_p above 1": ({"top_p": 1.5}, "top_p must be in (0, 1]"),
    "NaN top_p": ({"top_p": math.nan}, "top_p must be in (0, 1]"),
    "negative top_k": ({"top_k": -1}, "top_k must be an integer >= 0"),
    "max_prefill_chunk 0": ({"max_prefill_chunk": 0}, "max_prefill_chunk is 0"),
    "negative max_prefill_chunk": ({"max_prefill_chunk": -3}, "max_prefill_chunk is -3"),
}


@pytest.mark.parametrize("case", list(BAD_DEFAULTS))
def test_invalid_defaults_are_refused_at_parse_time(case, work, capsys):
    update, message = BAD_DEFAULTS[case]
    edit_manifest(work / "bundle", lambda m: m["defaults"].update(update))
    with pytest.raises(ManifestError, match=message.replace("(", r"\(").replace("]", r"\]")):
        read_manifest(work / "bundle")
    refused(capsys, main, ["inspect", "bundle", "--no-verify"], message, work)


@pytest.mark.parametrize("temperature", [0, 0.7, -1, -0.0, math.nan, math.inf, True, "1"])
@pytest.mark.parametrize("top_k, top_p", [(0, 1.0), (5, 0.9), (-1, 1.0), (2.5, 1.0), (0, 0), (0, 1.5), (0, math.nan),
                                          (0, True), (True, 1.0)])
def test_defaults_follow_the_request_rules(temperature, top_k, top_p):
    """The manifest's check and GenerationConfig refuse the same values, for the same option."""
    problem = sampling_problem(temperature, top_k, top_p)
    try:
        GenerationConfig(temperature=temperature, top_k=top_k, top_p=top_p)
        request = None
    except ConfigError as exc:
        request = exc.message.split()[0]
    assert (problem[0].split()[0] if problem else None) == request


def test_a_manifest_too_deep_for_python_is_a_message(work, capsys):
    (work / "bundle" / "manifest.json").write_text('{"schema_version": 1, "tools": ' + "[" * 100_000 + "]" * 100_000 + "}")
    refused(capsys, main, ["inspect", "bundle"], "nesting too deep", work)


def test_a_manifest_that_is_not_utf8_is_a_message(work, capsys):
    (work / "bundle" / "manifest.json").write_bytes(b'{"schema_version": 1, "name": "caf\xe9"}')
    refused(capsys, main, ["inspect", "bundle"], "not UTF-8", work)


# a manifest that the graph contradicts (vocabulary, KV dtype, layers) is refused at load on onnxruntime.
GRAPH_EDITS = {  # name: (edit of each model entry, lowerings where the old check missed it)
    "a larger vocab": (lambda e: e["dims"].update(vocab_size=e["dims"]["vocab_size"] + 64), ("plain", "gqa")),
    "kv_dtype float16": (lambda e: e.update(kv_dtype="float16"), ("plain", "gqa")),
    "fewer layers": (lambda e: e["dims"].update(num_layers=1), ("gqa",)),
}


@pytest.mark.parametrize("case, lowering", [(c, lw) for c, (_, lows) in GRAPH_EDITS.items() for lw in lows])
def test_a_manifest_the_graph_contradicts_is_refused(case, lowering, work, gqa_int4_bundle, capsys):
    if lowering == "gqa":
        shutil.rmtree(work / "bundle")
        shutil.copytree(gqa_int4_bundle, work / "bundle")
    edit = GRAPH_EDITS[case][0]
    edit_manifest(work / "bundle", lambda m: [edit(entry) for entry in m["models"].values()])
    refused(capsys, main, ["generate", "bundle", "--backend", "onnxruntime", *GENERATE], "does not match its graph", work)


# a GGUF cut inside its header; a weights or tokenizer file truncated, or linked from outside the bundle.
@pytest.fixture(scope="module")
def small_gguf(tmp_path_factory) -> Path:
    """A complete GGUF whose header holds a token list of about 4 kB."""
    gguf = pytest.importorskip("gguf")
    import numpy as np

    path = tmp_path_factory.mktemp("gguf") / "small.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(2)
    writer.add_context_length(64)
    writer.add_token_list([f"tok{i}" for i in range(300)])
    writer.add_tensor("token_embd.weight", np.zeros((300, 32), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize("keep", [40, 2000], ids=["in the first key", "in the token list"])
def test_a_gguf_cut_inside_its_header_is_a_message(small_gguf, keep, work, capsys):
    (work / "cut.gguf").write_bytes(small_gguf.read_bytes()[:keep])
    refused(capsys, export_main, ["--target", "cut.gguf", "--out", "o", *EXPORT, "--skip-parity"],
            "is truncated or corrupt", work)


@pytest.mark.parametrize("rel", ["target/model.onnx.data", "target/model.onnx", "tokenizer.json"])
def test_a_file_linked_from_outside_the_bundle_is_refused(rel, work, capsys):
    (work / "elsewhere").mkdir()
    shutil.move(work / "bundle" / rel, work / "elsewhere" / "file")
    (work / "bundle" / rel).symlink_to(work / "elsewhere" / "file")
    for verify in ([], ["--no-verify"]):
        refused(capsys, main, ["generate", "bundle", *verify, "--backend", "onnxruntime", *GENERATE],
                "outside the bundle", work)


@pytest.mark.parametrize("rel, message", [("tokenizer.json", "truncated or corrupt"),
                                          ("target/model.onnx.data", "onnxruntime cannot load")])
def test_a_truncated_file_with_no_verify_is_a_message(rel, message, work, capsys):
    path = work / "bundle" / rel
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    refused(capsys, main, ["generate", "bundle", "--no-verify", "--backend", "onnxruntime", *GENERATE], message, work)


# `calibrate report` checks --out and --csv before it measures, and replaces a file only with --overwrite.
@pytest.mark.parametrize("outputs, message", [(["--out", "old.md"], "already exists"),
                                              (["--out", "new.md", "--csv", "old.md"], "already exists"),
                                              (["--out", "folder"], "is a directory"),
                                              (["--out", "new.md", "--csv", "./new.md"], "the same file"),
                                              (["--out", "nowhere/new.md"], "folder 'nowhere' does not exist")])
def test_report_outputs_are_checked_before_measuring(outputs, message, work, capsys):
    """'missing' is no bundle: the command only reaches it after measuring the reference's rows."""
    (work / "old.md").write_text("keep")
    (work / "folder").mkdir()
    refused(capsys, main, ["calibrate", "report", "missing", "--reference", "bundle", *outputs], message, work)


def test_report_replaces_a_file_with_overwrite(work):
    (work / "old.md").write_text("keep")
    assert main(["calibrate", "report", "bundle", "--reference", "bundle", "--out", "old.md", "--csv", "old.csv",
                 "--overwrite", "--prompt", "The quick", "--max-new-tokens", "4"]) == 0
    assert (work / "old.md").read_text().startswith("| model |")
    assert (work / "old.csv").read_text().startswith("name,")


# `specdec bench --quick` on a base model's bundle (no chat template): the prompts go in as raw text.
def test_bench_quick_on_a_bundle_without_a_chat_template(work):
    pytest.importorskip("polars")
    from specdec.cli.bench import add_bench_parser

    bundle = work / "bundle"
    (bundle / "chat_template.jinja").unlink()
    edit_manifest(bundle, lambda m: (m["tokenizer"]["files"].pop("chat_template.jinja"),
                                     m["tokenizer"].update(has_chat_template=False)))
    parser = argparse.ArgumentParser(prog="specdec")
    add_bench_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["bench", str(bundle), "--quick", "--out", str(work / "out"), "--prompts", str(PROMPTS),
                              "--no-progress", "--no-plots", "--drafters", "model,prompt_lookup"])
    assert args.run(args) == 0
    assert "prompts as: raw text (the bundle has no chat template)" in (work / "out" / "summary.md").read_text()
