"""`specdec calibrate head BUNDLE` without --from: a head trained from a tiny target in seconds that loads and drafts
exactly (greedy output identical to target-only); the seed reproduces a run; --resume continues one; the training
loop stops at its deadline and resumes to the very weights of a run never stopped; every refusal has its hint."""
from __future__ import annotations

import itertools
import json

import numpy as np
import pytest
import torch

import specdec
from specdec.cli.main import main
from specdec.manifest import read_manifest
from specdec.native import build
from specdec.runtime import GenerationConfig

pytestmark = pytest.mark.skipif(bool(build.missing_cpu_flags()), reason="the native kernels need AVX2, FMA, F16C")
TINY = ["--data-tokens", "60", "--max-new-tokens", "12", "--rows", "3", "--draft-vocab", "96", "--steps", "3",
        "--threads", "1"]


def _head_arrays(bundle) -> dict:
    with np.load(bundle / "head" / "head.npz") as archive:
        return {name: archive[name] for name in archive.files}


@pytest.fixture(scope="module")
def trained(native_bundle, tmp_path_factory):
    out = tmp_path_factory.mktemp("trained") / "out"
    assert main(["calibrate", "head", str(native_bundle), "--out", str(out), *TINY]) == 0
    return out


def test_a_trained_head_loads_and_drafts_exactly(trained, native_bundle):
    record = read_manifest(trained).head
    assert record.source.startswith("trained") and record.draft_vocab_size == 96
    assert read_manifest(native_bundle).head is None  # --out: the source bundle is left as it was
    summary = json.loads((trained.with_name("out.head-train") / "run.json").read_text())["summary"]
    assert summary["training"]["steps"] == 3 and summary["data"]["answer_tokens"] >= 60
    assert summary["training"]["precision"] in ("bf16", "fp32")
    with specdec.load(trained, backend="native", threads=1) as generator:
        for prompt in ("Hello there", "Write a poem about the sea"):
            plain = generator.generate(prompt, GenerationConfig(max_new_tokens=24, temperature=0.0, drafter="none"))
            for gamma in (1, 3):
                drafted = generator.generate(prompt, GenerationConfig(max_new_tokens=24, temperature=0.0,
                                                                      drafter="head", gamma=gamma))
                assert drafted.token_ids == plain.token_ids and drafted.stats.proposed > 0


def test_the_seed_reproduces_a_run_and_resume_continues_it(trained, native_bundle, tmp_path):
    again = tmp_path / "again"
    assert main(["calibrate", "head", str(native_bundle), "--out", str(again), *TINY]) == 0
    first, second = _head_arrays(trained), _head_arrays(again)
    assert all(np.array_equal(first[name], second[name]) for name in first)
    work = trained.with_name("out.head-train")
    shards = sorted(p.name for p in (work / "data").iterdir())
    resumed = tmp_path / "resumed"
    assert main(["calibrate", "head", str(native_bundle), "--out", str(resumed), "--work", str(work), "--resume",
                 *TINY]) == 0  # its data and its finished training: attached again, nothing recomputed
    assert sorted(p.name for p in (work / "data").iterdir()) == shards
    assert all(np.array_equal(first[name], value) for name, value in _head_arrays(resumed).items())


def _trainer(bundle, data, work, held_out: int = 0, bf16: bool = False):
    from specdec.calibration.head_train.shards import Shards
    from specdec.calibration.head_train.stages import _head
    from specdec.calibration.head_train.train import TrainPlan, Trainer

    torch.manual_seed(0)
    manifest = read_manifest(bundle)
    ids = np.arange(0, manifest.target.dims.vocab_size, 2)
    head, _ = _head(bundle, manifest, ids, 0)
    to_draft = torch.full((manifest.target.dims.vocab_size,), -1, dtype=torch.int64)
    to_draft[torch.from_numpy(ids)] = torch.arange(len(ids))
    work.mkdir(exist_ok=True)
    plan = TrainPlan(batch_tokens=24, checkpoint_every=2, held_out=held_out, bf16=bf16)
    ticks = itertools.count()
    return Trainer(head, Shards(data), to_draft, plan, work, lambda: float(next(ticks))), head


def test_training_stops_at_its_deadline_and_resumes_to_the_same_weights(trained, native_bundle, tmp_path):
    torch.set_num_threads(1)
    data = trained.with_name("out.head-train") / "data"
    whole, head = _trainer(native_bundle, data, tmp_path / "whole")
    assert whole.run(5, None, None, resume=False).steps == 5
    stopped, _ = _trainer(native_bundle, data, tmp_path / "parts")
    assert stopped.run(5, None, deadline=2.5, resume=False).steps == 2  # the clock ticks once a step here
    resumed, again = _trainer(native_bundle, data, tmp_path / "parts")
    result = resumed.run(5, None, None, resume=True)
    assert result.steps == 5 and result.total == 5
    for name, value in head.state_dict().items():
        assert torch.equal(value, again.state_dict()[name]), name
    fitted, _ = _trainer(native_bundle, data, tmp_path / "fitted")
    assert fitted.run(50, fit_to=12.0, deadline=None, resume=False).total < 50  # planned to end by the deadline


def test_a_plan_fitted_to_a_deadline_grows_while_the_pace_quickens_early_and_only_shrinks_late(trained, native_bundle,
                                                                                              tmp_path):
    torch.set_num_threads(1)
    data = trained.with_name("out.head-train") / "data"

    def run(pace) -> int:  # pace(call) -> seconds the clock moves at its call-th reading
        trainer, _ = _trainer(native_bundle, data, tmp_path / str(len(list(tmp_path.iterdir()))))
        now, calls = [0.0], itertools.count()
        trainer.clock = lambda: now.__setitem__(0, now[0] + pace(next(calls))) or now[0]
        return trainer.run(40, fit_to=60.0, deadline=None, resume=False).total

    steady = run(lambda call: 4.0)  # 4 s a reading from the first: a plan of about 60 / 8 steps, never more
    quicker = run(lambda call: 4.0 if call < 4 else 0.5)  # slow at the probe, then quick: the plan grows
    assert steady < quicker <= 40, (steady, quicker)
    late = run(lambda call: 4.0 if call < 12 else 0.01)  # quick only once half the plan is done: no growth
    assert late <= steady, (late, steady)


def test_bf16_training_follows_the_fp32_run_closely(trained, native_bundle, tmp_path):
    torch.set_num_threads(1)
    data = trained.with_name("out.head-train") / "data"
    runs = {}
    for bf16 in (False, True):
        trainer, head = _trainer(native_bundle, data, tmp_path / str(bf16), bf16=bf16)
        start = {name: value.clone() for name, value in head.state_dict().items()}
        trainer.run(6, None, None, resume=False)
        runs[bf16] = head.state_dict()
    trained = [name for name, value in start.items() if value.is_floating_point()]
    moved = sum(float((runs[False][name] - start[name]).square().sum()) for name in trained) ** 0.5
    apart = sum(float((runs[True][name] - runs[False][name]).square().sum()) for name in trained) ** 0.5
    assert all(value.dtype == torch.float32 for value in runs[True].values() if value.is_floating_point())  # fp32 kept
    assert 0 < apart < 0.2 * moved, (apart, moved)  # bf16 products ran, and the steps went where fp32's went


def test_the_training_precision_follows_the_cpu(tmp_path):
    from specdec.calibration.head_train.config import HeadTrainConfig

    cpuinfo = tmp_path / "cpuinfo"
    for flags, auto in (("avx2 fma amx_bf16 amx_tile", True), ("avx2 avx512f avx512_bf16", True), ("avx2 fma", False)):
        cpuinfo.write_text(f"flags\t\t: {flags}\n")
        assert HeadTrainConfig().bf16(cpuinfo) is auto
        assert HeadTrainConfig(precision="fp32").bf16(cpuinfo) is False
        assert HeadTrainConfig(precision="bf16").bf16(cpuinfo) is True
    with pytest.raises(specdec.errors.ConfigError, match="--precision must be one of auto, bf16, fp32"):
        HeadTrainConfig(precision="half")


@pytest.mark.parametrize("argv, message", [
    (["--steps", "0"], "--steps must be a positive integer"),
    (["--minutes", "-1"], "--minutes must be a positive number"),
    (["--draft-vocab", "0"], "--draft-vocab must be a positive integer"),
    (["--resume", "--overwrite"], "--resume continues a run and --overwrite starts it again"),
    (["--resume"], "holds no earlier run"),
    (["--from", "DIR", "--out", "x"], "--out is an option of training, and --from attaches a trained head"),
    (["--from", "DIR", "--activations", "fp32"], "--activations is an option of training"),
    (["--from", "DIR", "--precision", "bf16"], "--precision is an option of training"),
    (["--activations", "int8", "--out", "x"], "activations='int8' multiply blocked weights"),
    (["--max-new-tokens", "500", "--data-tokens", "60", "--out", "x"], "no training data was written"),
])
def test_bad_options_are_refused_with_a_hint(native_bundle, tmp_path, capsys, argv, message):
    argv = [a if a != "x" else str(tmp_path / "x") for a in argv]
    assert main(["calibrate", "head", str(native_bundle), "--work", str(tmp_path / "w"), *argv]) == 1
    err = capsys.readouterr().err
    assert message in err and "Hint:" in err and "Traceback" not in err


def test_bundles_it_cannot_train_on_are_refused_with_a_hint(int4_bundle, native_bundle, trained, tmp_path, capsys):
    cases = [([str(tmp_path / "nothing")], "does not exist"),
             ([str(int4_bundle), "--out", str(tmp_path / "o")], "has no native weights"),
             ([str(native_bundle), "--out", str(trained)], "already exists"),
             ([str(native_bundle), "--out", str(tmp_path / "o2"), "--work", str(trained.with_name("out.head-train"))],
              "the work folder")]
    for argv, message in cases:
        assert main(["calibrate", "head", *argv, *TINY]) == 1
        err = capsys.readouterr().err
        assert message in err and "Hint:" in err and "Traceback" not in err, (argv, err)
    assert not (tmp_path / "o").exists() and not (tmp_path / "o2").exists()


def test_a_budget_of_minutes_ends_the_run(native_bundle, tmp_path):
    out = tmp_path / "timed"
    assert main(["calibrate", "head", str(native_bundle), "--out", str(out), "--minutes", "0.01", "--data-tokens",
                 "100000", "--max-new-tokens", "8", "--rows", "3", "--draft-vocab", "64", "--threads", "1"]) == 0
    summary = json.loads((tmp_path / "timed.head-train" / "run.json").read_text())["summary"]
    assert summary["data"]["answer_tokens"] < 100000 and summary["training"]["steps"] < 100
    assert read_manifest(out).head is not None


def test_trim_head_keeps_the_tokens_of_most_label_mass_and_drafts_exactly(trained, tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    from specdec.calibration.head_train.init import label_mass
    from specdec.calibration.head_train.shards import Shards
    from specdec.head.format import read_head

    script = Path(__file__).resolve().parents[2] / "benchmarks" / "trim_head.py"
    run = lambda *args: subprocess.run([sys.executable, str(script), *map(str, args)],  # noqa: E731
                                       capture_output=True, text=True, timeout=300)
    out = tmp_path / "trimmed"
    done = run(trained, 40, "--out", out)
    assert done.returncode == 0, done.stderr
    manifest = read_manifest(out)
    full, cut = read_head(trained, read_manifest(trained).head), read_head(out, manifest.head)
    assert manifest.head.draft_vocab_size == len(cut.draft_ids) == 40 and np.all(np.diff(cut.draft_ids) > 0)
    rows = np.searchsorted(full.draft_ids, cut.draft_ids)
    assert np.array_equal(full.draft_ids[rows], cut.draft_ids)  # a subset of the head's own tokens...
    assert np.array_equal(cut.lm_head, full.lm_head[rows]) and np.array_equal(cut.fc, full.fc)  # ... their rows
    mass = label_mass(Shards(trained.with_name("out.head-train") / "data"), manifest.target.dims.vocab_size)
    eos = set(manifest.tokenizer.eos_token_ids)
    dropped = [t for t in full.draft_ids if t not in set(cut.draft_ids)]
    kept = [t for t in cut.draft_ids if t not in eos]
    assert eos <= set(cut.draft_ids.tolist()) and min(mass[kept]) >= max(mass[dropped])  # the most mass, EOS kept
    assert "40 draft tokens" in done.stdout
    with specdec.load(out, backend="native", threads=1) as generator:
        plain = generator.generate("Hello there", GenerationConfig(max_new_tokens=16, temperature=0.0,
                                                                  drafter="none"))
        drafted = generator.generate("Hello there", GenerationConfig(max_new_tokens=16, temperature=0.0,
                                                                    drafter="head", gamma=2))
        assert drafted.token_ids == plain.token_ids
    # a head that scores no EOS (an imported one may not): trimmed, its rows still its own tokens'
    import dataclasses
    import shutil

    from specdec.head.format import attach_head

    no_eos = shutil.copytree(trained, tmp_path / "no_eos")
    shutil.copytree(trained.with_name("out.head-train"), tmp_path / "no_eos.head-train", symlinks=True)
    rows = np.flatnonzero(~np.isin(full.draft_ids, list(eos)))
    attach_head(no_eos, dataclasses.replace(full, lm_head=full.lm_head[rows], draft_ids=full.draft_ids[rows]),
                dataclasses.replace(read_manifest(trained).head, draft_vocab_size=len(rows)))
    assert run(no_eos, 40, "--out", tmp_path / "no_eos_cut").returncode == 0
    cut = read_head(tmp_path / "no_eos_cut", read_manifest(tmp_path / "no_eos_cut").head)
    assert not eos & set(cut.draft_ids.tolist())
    assert np.array_equal(cut.lm_head, full.lm_head[np.searchsorted(full.draft_ids, cut.draft_ids)])
    for args, why in (((trained, 97, "--out", tmp_path / "a"), "the head has 96"),
                      ((trained, 40, "--out", out), "exists"),
                      ((trained, 40, "--out", tmp_path / "b", "--work", tmp_path), "holds no training data")):
        done = run(*args)
        assert done.returncode == 1 and why in done.stderr and "Hint:" in done.stderr, done.stderr
        assert "Traceback" not in done.stderr
