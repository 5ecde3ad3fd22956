"""Requests the target writes itself (--asked-share, head_train.asked): the templated prompts of a seed stay what
they were, the share is kept, a request is the target's sampled text after its chat template's user-turn prefix
(the same for the same seed and index), and a data run on asked prompts trains on conversations that begin there."""
from __future__ import annotations

import json

import pytest

import specdec
from specdec.calibration.head_train.asked import user_turn_prefix
from specdec.calibration.head_train.prompts import training_prompts
from specdec.calibration.head_train.shards import Shards
from specdec.cli.main import main
from specdec.native import build

needs_native = pytest.mark.skipif(bool(build.missing_cpu_flags()), reason="the native kernels need AVX2, FMA, F16C")


def test_asked_prompts_leave_the_templated_ones_of_the_seed_as_they_were():
    mixed = training_prompts(600, seed=5, asked_share=0.4)
    templated = [p for p in mixed if not p.asked]
    assert len(mixed) == 600 and templated == training_prompts(len(templated), seed=5)
    assert 0.3 < sum(p.asked for p in mixed) / len(mixed) < 0.5
    assert all(p.chat and p.text == "" for p in mixed if p.asked)
    assert mixed == training_prompts(600, seed=5, asked_share=0.4)
    assert all(p.asked for p in training_prompts(50, seed=5, asked_share=1.0))
    assert not any(p.asked for p in training_prompts(50, seed=5))


@needs_native
def test_the_user_turn_prefix_begins_every_chat_prompt(native_bundle):
    with specdec.load(native_bundle, backend="native", threads=1) as generator:
        prefix = user_turn_prefix(generator.requests)
        whole = generator.requests.prompt_ids("Tell me about the sea", chat=True)
        assert 0 < len(prefix) < len(whole) and whole[: len(prefix)] == prefix


def _asked_run(bundle, out, rows: int) -> list:
    """The sequences (token ids) of a data run of asked prompts answered `rows` at a time."""
    assert main(["calibrate", "head", str(bundle), "--out", str(out), "--asked-share", "1", "--data-tokens", "40",
                 "--max-new-tokens", "8", "--rows", str(rows), "--draft-vocab", "64", "--steps", "1",
                 "--threads", "1"]) == 0
    shards = Shards(out.with_name(out.name + ".head-train") / "data")
    return [list(row) for row in shards.batch(list(range(len(shards)))).tokens]


@needs_native
def test_requests_the_target_writes_are_its_own_whatever_rows_share_the_passes(native_bundle, tmp_path):
    """A request is sampled from a stream seeded by (seed, prompt index) in a row of its own, batched with rows that
    answer: the data is the same whether one row or three write and answer, and the requests differ."""
    alone, together = _asked_run(native_bundle, tmp_path / "one", 1), _asked_run(native_bundle, tmp_path / "three", 3)
    assert alone == together
    assert len({tuple(row) for row in alone}) > len(alone) // 2


@needs_native
def test_a_data_run_of_asked_prompts_trains_on_conversations_from_the_user_turn(native_bundle, tmp_path):
    out = tmp_path / "asked"
    assert main(["calibrate", "head", str(native_bundle), "--out", str(out), "--asked-share", "1", "--data-tokens",
                 "40", "--max-new-tokens", "8", "--rows", "3", "--draft-vocab", "64", "--steps", "1",
                 "--threads", "1"]) == 0
    work = tmp_path / "asked.head-train"
    record = json.loads((work / "run.json").read_text())
    assert record["options"]["asked_share"] == 1 and record["summary"]["data"]["asked"] > 0
    with specdec.load(native_bundle, backend="native", threads=1) as generator:
        prefix = user_turn_prefix(generator.requests)
    shards = Shards(work / "data")
    batch = shards.batch(list(range(len(shards))))
    assert len(shards) and all(list(row[: len(prefix)]) == prefix for row in batch.tokens)


@pytest.mark.parametrize("argv, message", [
    (["--asked-share", "1.5"], "--asked-share must be a number from 0 to 1"),
    (["--from", "DIR", "--asked-share", "0.5"], "--asked-share is an option of training"),
])
def test_bad_asked_shares_are_refused_with_a_hint(native_bundle, tmp_path, capsys, argv, message):
    assert main(["calibrate", "head", str(native_bundle), "--work", str(tmp_path / "w"), *argv]) == 1
    err = capsys.readouterr().err
    assert message in err and "Hint:" in err and "Traceback" not in err


@needs_native
def test_a_run_recorded_before_asked_prompts_existed_resumes_with_their_default(native_bundle, tmp_path, capsys):
    tiny = ["--data-tokens", "30", "--max-new-tokens", "6", "--rows", "3", "--draft-vocab", "64", "--steps", "1",
            "--threads", "1"]
    work = tmp_path / "w"
    assert main(["calibrate", "head", str(native_bundle), "--out", str(tmp_path / "a"), "--work", str(work),
                 *tiny]) == 0
    record = json.loads((work / "run.json").read_text())
    del record["options"]["asked_share"]  # as a run of an earlier specdec wrote it
    (work / "run.json").write_text(json.dumps(record))
    assert main(["calibrate", "head", str(native_bundle), "--out", str(tmp_path / "b"), "--work", str(work),
                 "--resume", *tiny]) == 0
    assert main(["calibrate", "head", str(native_bundle), "--out", str(tmp_path / "c"), "--work", str(work),
                 "--resume", "--asked-share", "0.5", *tiny]) == 1
    err = capsys.readouterr().err
    assert "was made with other asked_share" in err and "Hint:" in err
