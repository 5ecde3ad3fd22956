"""`specdec calibrate ...` end to end, and its error path (message + Hint, exit code 1)."""
from __future__ import annotations

import argparse
import dataclasses

from specdec.calibration.bundle_io import write_manifest
from specdec.cli.main import _dispatch
from specdec.cli.calibrate import add_calibrate_parser
from specdec.manifest import read_manifest


def _run(argv):
    parser = argparse.ArgumentParser(prog="specdec")
    parser.add_argument("-v", "--verbose", action="store_true")
    add_calibrate_parser(parser.add_subparsers(dest="command", required=True))
    return _dispatch(parser, argv)


def test_quantize_report_and_gamma(int4_bundle, tmp_path, capsys):
    out = tmp_path / "q41"
    assert _run(["calibrate", "quantize", str(int4_bundle), "--method", "int4-q41", "--out", str(out),
                 "--q41-minimum", "exact"]) == 0
    draft = read_manifest(out).draft
    assert draft.derived == "int4-q41" and draft.calibration.details["minimum"] == "exact"
    table = tmp_path / "report.md"
    assert _run(["calibrate", "report", str(out), "--reference", str(int4_bundle), "--out", str(table), "--csv",
                 str(tmp_path / "r.csv"), "--seq-len", "16", "--max-new-tokens", "12", "--prompt", "Once upon"]) == 0
    text = table.read_text()
    assert "top-1 agr." in text and "q41/draft" in text and (tmp_path / "r.csv").read_text().startswith("name,")
    assert _run(["calibrate", "gamma", str(out), "--dry-run", "--max-new-tokens", "12", "--prompt", "Once upon"]) == 0
    assert "dry run" in capsys.readouterr().out


def test_errors_print_a_hint_and_exit_1(int4_bundle, tmp_path, capsys):
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    argv = ["calibrate", "quantize", str(int4_bundle), "--method", "int8-qdq", "--out", str(tmp_path / "o"),
            "--data", str(empty)]
    assert _run(argv) == 1
    err = capsys.readouterr().err
    assert "error: calibration data" in err and "Hint:" in err and "Traceback" not in err
    assert _run(["calibrate", "quantize", str(int4_bundle), "--method", "int4-rtn", "--backend", "tensorrt",
                 "--out", str(tmp_path / "o")]) == 1
    assert "not supported by the tensorrt back end" in capsys.readouterr().err
    assert _run(["calibrate", "quantize", str(int4_bundle), "--method", "int4-rtn", "--q41-minimum", "exact",
                 "--out", str(tmp_path / "o")]) == 1
    err = capsys.readouterr().err
    assert "--q41-minimum exact with int4-rtn" in err and "Hint: it is for --method int4-q41" in err


def test_source_draft_of_a_bundle_without_draft_is_refused(bundle_copy, tmp_path, capsys):
    manifest = read_manifest(bundle_copy)
    write_manifest(bundle_copy, dataclasses.replace(manifest, models={"target": manifest.target}))
    argv = ["calibrate", "quantize", str(bundle_copy), "--method", "int4-rtn", "--source", "draft",
            "--out", str(tmp_path / "o")]
    assert _run(argv) == 1
    err = capsys.readouterr().err
    assert "has no draft to quantize" in err and "Hint:" in err and "Traceback" not in err
    assert not (tmp_path / "o").exists()
