"""Every export error path: a SpecDecError with a Hint, exit code 1, no traceback, nothing left behind."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from specdec.cli import export_main, main
from specdec.export.tiny import save_tiny
from specdec.manifest import read_manifest


def _fails(capsys, argv, expected: str, entry=export_main):
    assert entry(argv) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert expected in err, err
    assert "Hint:" in err
    return err


def _leftovers(folder):
    return [p.name for p in folder.iterdir() if p.name.endswith(".partial")]


def test_missing_path(capsys, tmp_path):
    _fails(capsys, ["--target", str(tmp_path / "missing"), "--out", str(tmp_path / "o")], "does not exist")
    _fails(capsys, ["--target", "./nowhere/model.gguf", "--out", str(tmp_path / "o")], "does not exist")


def test_hub_id_not_in_cache_fails_at_once(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    _fails(capsys, ["--target", "someone/not-cached-model", "--out", str(tmp_path / "o")], "local Hugging Face cache")


def test_unsupported_architecture(capsys, tmp_path):
    from transformers import BertConfig

    BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
               intermediate_size=32).save_pretrained(tmp_path / "bert")
    err = _fails(capsys, ["--target", str(tmp_path / "bert"), "--out", str(tmp_path / "o")], "not supported")
    assert "llama" in err and "gpt2" in err


def test_directory_without_config(capsys, tmp_path):
    (tmp_path / "empty").mkdir()
    _fails(capsys, ["--target", str(tmp_path / "empty"), "--out", str(tmp_path / "o")], "without config.json")


def test_tokenizers_that_differ(capsys, tmp_path, tiny_llama):
    other = save_tiny(tmp_path / "other", "llama", vocab_size=300)
    _fails(capsys, ["--target", str(tiny_llama), "--draft", str(other), "--out", str(tmp_path / "o"), "--max-seq-len", "64"],
           "different tokenizer")
    assert _leftovers(tmp_path) == []


def test_same_vocabulary_size_but_other_token_ids(capsys, tmp_path, tiny_llama):
    other = save_tiny(tmp_path / "shuffled", "llama")
    data = json.loads((other / "tokenizer.json").read_text())
    vocab = data["model"]["vocab"]
    a, b = sorted(vocab)[100], sorted(vocab)[101]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (other / "tokenizer.json").write_text(json.dumps(data))
    _fails(capsys, ["--target", str(tiny_llama), "--draft", str(other), "--out", str(tmp_path / "o"), "--max-seq-len", "64"],
           "different tokenizer")


@pytest.mark.parametrize("value", ["0", "-3"])
def test_max_seq_len_not_positive(capsys, tmp_path, tiny_llama, value):
    _fails(capsys, ["--target", str(tiny_llama), "--out", str(tmp_path / "o"), "--max-seq-len", value],
           "--max-seq-len must be a positive integer")


def test_max_seq_len_beyond_positions(capsys, tmp_path, tiny_llama):
    _fails(capsys, ["--target", str(tiny_llama), "--out", str(tmp_path / "o"), "--max-seq-len", "4096"],
           "exceeds the target's 512 positions")
    assert _leftovers(tmp_path) == []


@pytest.mark.parametrize("value", ["2", "7"])
def test_draft_layers_out_of_range(capsys, tmp_path, tiny_llama, value):
    _fails(capsys, ["--target", str(tiny_llama), "--out", str(tmp_path / "o"), "--draft-layers", value,
                    "--max-seq-len", "64"], "out of range")
    assert _leftovers(tmp_path) == [] and not (tmp_path / "o").exists()


def test_conflicting_draft_options(capsys, tmp_path, tiny_llama):
    _fails(capsys, ["--target", str(tiny_llama), "--out", str(tmp_path / "o"), "--no-draft", "--draft-layers", "1"],
           "conflicting draft options")


def test_existing_output_without_overwrite(capsys, tmp_path, tiny_llama):
    (tmp_path / "o").mkdir()
    (tmp_path / "o" / "keep.txt").write_text("mine")
    _fails(capsys, ["--target", str(tiny_llama), "--out", str(tmp_path / "o"), "--max-seq-len", "64"], "already exists")
    assert (tmp_path / "o" / "keep.txt").read_text() == "mine"


def test_output_that_cannot_be_written(capsys, tmp_path, tiny_llama):
    (tmp_path / "file").write_text("x")
    _fails(capsys, ["--target", str(tiny_llama), "--out", str(tmp_path / "file" / "bundle"), "--max-seq-len", "64"],
           "cannot write")


def test_layer_draft_export_and_overwrite(capsys, tmp_path, tiny_llama):
    out = tmp_path / "o"
    argv = ["--target", str(tiny_llama), "--out", str(out), "--draft-layers", "1", "--max-seq-len", "64"]
    assert export_main(argv) == 0
    assert export_main(argv + ["--overwrite"]) == 0
    assert _leftovers(tmp_path) == []
    manifest = read_manifest(out)
    assert (manifest.target.dims.num_layers, manifest.draft.dims.num_layers) == (2, 1)
    assert all(step.max_abs_diff <= step.tolerance for step in manifest.draft.parity)
    assert main(["inspect", str(out)]) == 0
    text = capsys.readouterr().out
    assert "derived: layers:1" in text and "hashes: verified" in text and "rollback_decode2" in text
    assert "native activations fp32" in text  # fp32 rows: nothing for int8 activations to multiply


def test_cli_entry_point_prints_no_traceback(tmp_path):
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    proc = subprocess.run([sys.executable, "-m", "specdec.cli", "inspect", str(tmp_path / "none")],
                          capture_output=True, text=True, env=env)
    assert proc.returncode == 1
    assert "Traceback" not in proc.stderr and "Hint:" in proc.stderr
    verbose = subprocess.run([sys.executable, "-m", "specdec.cli", "-v", "inspect", str(tmp_path / "none")],
                             capture_output=True, text=True, env=env)
    assert verbose.returncode == 1 and "Traceback" in verbose.stderr


def test_quantized_layer_draft_export(capsys, tmp_path, tiny_llama):
    out = tmp_path / "o"
    argv = ["--target", str(tiny_llama), "--out", str(out), "--draft-layers", "1", "--quantize", "int4-rtn",
            "--max-seq-len", "64", "--skip-parity", "--calibration-seq-len", "16"]
    assert export_main(argv) == 0
    assert "draft = draft quantized with int4-rtn" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["o"]  # no staging or partial directory is left
    manifest = read_manifest(out)
    draft = manifest.draft
    assert (manifest.target.dims.num_layers, draft.dims.num_layers) == (2, 1)
    assert (draft.derived, draft.precision, draft.calibration.method) == ("layers:1+int4-rtn", "int4", "int4-rtn")
    assert draft.calibration.origin == "draft/model.onnx (fp32 draft, layers:1)"
    assert main(["inspect", str(out)]) == 0 and "hashes: verified" in capsys.readouterr().out


def test_quantized_target_as_draft_export(capsys, tmp_path, tiny_llama):
    out = tmp_path / "o"
    argv = ["--target", str(tiny_llama), "--out", str(out), "--quantize", "int4-q41", "--max-seq-len", "64",
            "--skip-parity"]
    assert export_main(argv) == 0
    draft = read_manifest(out).draft
    assert (draft.dims.num_layers, draft.derived, draft.calibration.origin) == (2, "int4-q41",
                                                                                 "target/model.onnx (fp32 target)")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["o"]


@pytest.mark.parametrize("extra, expected", [
    (["--draft-from-target", "int4"], "conflicts with --draft-from-target"),
    (["--no-draft"], "conflicts with --no-draft"),
    (["--draft", "some/draft"], "conflicts with --draft"),
    (["--dtype", "fp16"], "--quantize int4-rtn with --dtype fp16"),
    (["--engine", "tensorrt"], "not supported by the tensorrt back end"),
    (["--calibration-data", "missing.jsonl"], "does not exist"),
    (["--quantize", "modelopt-int8"], "needs the plain lowering"),
])
def test_quantize_option_errors(capsys, tmp_path, tiny_llama, extra, expected):
    argv = ["--target", str(tiny_llama), "--out", str(tmp_path / "o"), "--quantize", "int4-rtn"] + extra
    _fails(capsys, argv, expected)
    assert list(tmp_path.iterdir()) == []


def test_calibration_options_need_quantize(capsys, tmp_path, tiny_llama):
    _fails(capsys, ["--target", str(tiny_llama), "--out", str(tmp_path / "o"), "--calibration-samples", "4"],
           "without --quantize")


def test_quantize_error_after_the_export_leaves_nothing(capsys, tmp_path, tiny_llama):
    argv = ["--target", str(tiny_llama), "--out", str(tmp_path / "o"), "--quantize", "int4-rtn", "--max-seq-len", "64",
            "--skip-parity", "--calibration-seq-len", "100000"]  # too long for the built-in texts: fails at quantize
    _fails(capsys, argv, "one window needs 100000")
    assert list(tmp_path.iterdir()) == []


def test_weights_option_errors(capsys, tmp_path, tiny_llama):
    """--weights rounds an fp32 graph's weights: not with a half-precision --dtype, and not past fp16's range."""
    import torch
    from transformers import AutoModelForCausalLM

    _fails(capsys, ["--target", str(tiny_llama), "--out", str(tmp_path / "o"), "--weights", "bf16", "--dtype", "bf16"],
           "--weights bf16 with --dtype bf16")
    big = tmp_path / "big"
    model = AutoModelForCausalLM.from_pretrained(tiny_llama)
    with torch.no_grad():
        model.model.layers[0].mlp.down_proj.weight[0, :3] = 1e5  # past fp16's 65504, within bf16's range
    model.save_pretrained(big)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (tiny_llama / name).exists():
            (big / name).write_bytes((tiny_llama / name).read_bytes())
    err = _fails(capsys, ["--target", str(big), "--out", str(tmp_path / "o"), "--weights", "fp16", "--no-draft",
                          "--max-seq-len", "64"],
                 "--weights fp16: 3 values of model.layers.0.mlp.down_proj.weight lie outside fp16's range")
    assert "--weights bf16" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["big"]


def test_export_prints_no_torchvision_warnings(tmp_path):
    """torch.onnx's registry warns that torchvision (nms, roi_align: ops no causal LM uses) is missing; users read
    those lines as errors of the export. A fresh process, as the first export of a session is the one that warns."""
    model = save_tiny(tmp_path / "hf", "llama", seed=0)
    done = subprocess.run([sys.executable, "-c", "import sys; from specdec.cli import export_main; sys.exit(export_main())", "--target", str(model), "--out",
                           str(tmp_path / "b"), "--max-seq-len", "64"], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "torchvision" not in done.stderr and (tmp_path / "b" / "manifest.json").exists()
