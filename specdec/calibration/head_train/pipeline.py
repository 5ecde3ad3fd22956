"""`specdec calibrate head BUNDLE` without --from: train a head from the target, then attach it.

1. data: the target answers the training prompts (generate), its features and soft labels land in shards;
2. the draft vocabulary and the first weights from the target (init);
3. training (train, over TorchHead); 4. the head written into a copy of the bundle (--out) or the bundle itself.
Everything but the bundle lives in the work folder (shards, vocab.npy, checkpoint.pt, run.json); --resume picks up
where a stopped run left: a data stage that ended keeps its data as it is, one that was stopped goes on (its whole
shards kept), and training continues from its checkpoint.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import time
from pathlib import Path

import numpy as np

from specdec.calibration.head_train.config import HeadTrainConfig
from specdec.errors import ConfigError, ManifestError, missing_dependency
from specdec.manifest import Manifest, read_manifest
from specdec.publish import check_destination, staged_bundle, write_atomic

log = logging.getLogger(__name__)
RUN = "run.json"


def work_folder(bundle: Path, config: HeadTrainConfig) -> Path:
    if config.work is not None:
        return Path(config.work)
    where = Path(config.out) if config.out is not None else Path(bundle)
    return where.with_name(where.name + ".head-train")


def check_target(bundle: Path) -> Manifest:
    """The bundle's manifest; ManifestError where its target cannot feed training (no native weights)."""
    manifest = read_manifest(bundle)
    if manifest.target.native is None:
        raise ManifestError(f"training a head runs the target on specdec's native engine, and the target of {bundle} "
                            f"has no native weights ({manifest.target.native_note or 'not written'})",
                            "re-export the bundle with --lowering gqa (the default) from a LLaMA-layout model, or "
                            "attach a trained checkpoint with --from DIR")
    return manifest


def prepare_work(work: Path, config: HeadTrainConfig) -> None:
    """Create the work folder, or check the one a resumed run continues; refuse to mix two runs."""
    record = work / RUN
    if config.resume:
        if not record.is_file():
            raise ConfigError(f"--resume: {work} holds no earlier run ({RUN} is missing)",
                              "run without --resume to start one, or pass --work naming the earlier run's folder")
        earlier = _run_record(work)["options"]  # an option newer than the run it records has its default there
        defaults = HeadTrainConfig().fingerprint()
        changed = sorted(k for k, v in config.fingerprint().items() if earlier.get(k, defaults[k]) != v)
        if changed:
            raise ConfigError(f"--resume: the run in {work} was made with other {', '.join(changed)}",
                              "pass the options of the run you resume, or start again with --overwrite")
        return
    if work.exists():
        if not config.overwrite:
            raise ConfigError(f"the work folder {work} exists (an earlier run's data and checkpoint)",
                              "pass --resume to continue that run, --overwrite to start again, or another --work")
        if not (work / RUN).is_file():
            raise ConfigError(f"--overwrite: {work} is not a head-training work folder (no {RUN})",
                              "nothing was deleted; pass another --work, or remove it yourself")
        shutil.rmtree(work)
    work.mkdir(parents=True)
    write_atomic(work / RUN, json.dumps({"options": config.fingerprint()}))


def train_head(bundle: str | Path, config: HeadTrainConfig, progress: bool = False) -> dict:
    """Train a head for the bundle's target and attach it (to config.out, a copy, or the bundle); -> the run's
    summary (also in the work folder's run.json)."""
    # OpenMP workers that sleep when idle: spinning ones lose most of their time where other work shares the cores
    # (a user's own setting wins; read when torch loads, so before the first import)
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    try:
        import torch  # noqa: F401
    except ImportError:
        raise missing_dependency("torch", "export") from None
    bundle, started = Path(bundle), time.monotonic()
    manifest = check_target(bundle)
    if config.out is not None:
        check_destination(config.out, config.overwrite, sources=[bundle])
    work = work_folder(bundle, config)
    prepare_work(work, config)
    deadline = None if config.minutes is None else started + 60 * config.minutes
    from specdec.calibration.head_train.stages import attach, make_data, train_stage

    data = _run_record(work).get("data")  # a resumed run whose data stage ended keeps its data as it is
    if data is None:
        data = make_data(bundle, manifest, config, work, _share(started, deadline, config), progress)
        _update_record(work, data=data)
    trained, head = train_stage(bundle, manifest, config, work, deadline, progress)
    summary = {"data": data, "training": trained, "minutes": (time.monotonic() - started) / 60}
    source = (f"trained by specdec calibrate head: {data['answer_tokens']} answer tokens, {trained['steps']} steps, "
              f"seed {config.seed}")
    summary["head"] = dataclasses.asdict(attach(bundle, config, head, source))
    _update_record(work, summary=summary)
    return summary


def _run_record(work: Path) -> dict:
    return json.loads((work / RUN).read_text(encoding="utf-8"))


def _update_record(work: Path, **fields) -> None:
    write_atomic(work / RUN, json.dumps(_run_record(work) | fields, indent=1, default=_plain))


def _share(started: float, deadline: float | None, config: HeadTrainConfig) -> float | None:
    return None if deadline is None else started + (deadline - started) * config.data_share


def _plain(value):
    return value.tolist() if isinstance(value, np.ndarray) else str(value)


def copy_bundle(bundle: Path, out: Path, attach_to) -> None:
    """Write `out`: a copy of `bundle` given its head by attach_to(folder), published whole."""
    with staged_bundle(out) as staged:
        for path in bundle.rglob("*"):
            if path.is_file():
                target = staged / path.relative_to(bundle)
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(path, target)
        attach_to(staged)
