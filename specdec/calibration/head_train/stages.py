"""The stages of a training run (specdec.calibration.head_train.pipeline): data, training, attaching."""
from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import numpy as np

from specdec.calibration.head_train.asked import ASK_TOKENS, user_turn_prefix
from specdec.calibration.head_train.config import HeadTrainConfig, Precision
from specdec.calibration.head_train.generate import Answering, Ask, Budget, DataPlan, ShardRun
from specdec.calibration.head_train.prompts import training_prompts
from specdec.calibration.head_train.shards import Shards, shard_meta, shard_numbers
from specdec.calibration.head_train.train import TrainPlan, Trainer
from specdec.errors import ConfigError
from specdec.manifest import Manifest
from specdec.runtime.config import RequestCapacityError
from specdec.runtime.forward import head_feature_layers

PROMPT_TOKENS = 40  # answer tokens a prompt is expected to give at least: prompts made = data tokens / this
VOCAB = "vocab.npy"


def _bar(progress: bool, unit: str, description: str, total=None):
    from tqdm.auto import tqdm

    return tqdm(total=total, unit=unit, desc=description, disable=not progress, dynamic_ncols=True)


def make_data(bundle: Path, manifest: Manifest, config: HeadTrainConfig, work: Path, deadline: float | None,
              progress: bool) -> dict:
    """Answer training prompts into work/data until config.data_tokens (or `deadline`); -> its size."""
    import specdec
    from specdec.runtime.native_backend import NativeBackend
    from specdec.runtime.registry import native_activations

    plan = DataPlan(rows=config.rows, max_new_tokens=config.max_new_tokens, seed=config.seed)
    prompts = training_prompts(config.data_tokens // PROMPT_TOKENS + plan.per_shard, config.seed, config.asked_share)
    room = manifest.target.max_seq_len - config.max_new_tokens
    layers = head_feature_layers(manifest.target.dims.num_layers)
    started = time.monotonic()
    with specdec.load(bundle, backend="native", threads=config.threads) as generator:

        prefix = user_turn_prefix(generator.requests) if any(p.asked for p in prompts) else []
        ask = Ask(tuple(prefix), max(1, min(ASK_TOKENS, (room - len(prefix)) // 2)))  # the request and the rest fit

        def ids_of(text: str, chat: bool):
            try:
                ids = generator.requests.prompt_ids(text, chat)
            except RequestCapacityError:  # longer than S: skipped
                return None
            return ids if len(ids) <= room else None

        def prompt_ids(index: int):
            return ask if prompts[index].asked else ids_of(prompts[index].text, prompts[index].chat)

        def asked_ids(index: int, request: list):  # a request the target wrote: white space alone is skipped
            text = generator.requests.codec.decode(request).strip()
            return ids_of(text, True) if text else None

        entry = dataclasses.replace(manifest.target, max_batch=config.rows)
        mode = native_activations(manifest, config.activations, None)  # the head drafts from the default mode's states
        target = NativeBackend(bundle, entry, threads=config.threads, activations=mode).open()
        try:
            target.reset(config.rows)
            answering = Answering(target, layers, manifest.tokenizer.eos_token_ids, plan)
            run = ShardRun(answering, prompt_ids, len(prompts), work / "data", Budget(config.data_tokens, deadline),
                           time.monotonic, asked_ids)
            with _bar(progress, "tok", "answers", config.data_tokens) as bar:
                tokens = run.run(bar)
        finally:
            target.close()
    shards = Shards(work / "data")
    if not len(shards):
        raise ConfigError(f"no training data was written: no prompt fits the {room} tokens the bundle's S = "
                          f"{manifest.target.max_seq_len} leaves beside --max-new-tokens {config.max_new_tokens}",
                          "pass a smaller --max-new-tokens, or use a bundle exported with a larger --max-seq-len")
    answered = [i for n in shard_numbers(work / "data") for i in shard_meta(work / "data", n)["prompts"]]
    return {"answer_tokens": tokens, "sequences": len(shards), "all_tokens": int(sum(
        shards.length(s) for s in range(len(shards)))), "prompts_made": len(prompts),
        "asked": sum(prompts[i].asked for i in answered if i < len(prompts)), "activations": str(mode),
        "seconds": time.monotonic() - started}  # asked: the answered prompts whose request the target wrote


def _vocabulary(work: Path, shards: Shards, manifest: Manifest, size: int) -> np.ndarray:
    from specdec.calibration.head_train.init import draft_vocabulary, label_mass

    path = work / VOCAB
    if path.is_file():
        return np.load(path)
    ids = draft_vocabulary(label_mass(shards, manifest.target.dims.vocab_size), size, manifest.tokenizer.eos_token_ids)
    np.save(path, ids)
    return ids


def _head(bundle: Path, manifest: Manifest, draft_ids: np.ndarray, seed: int):
    """The TorchHead of the first weights (init.initial_head) over the target's embedding."""
    from specdec.blocks import float_rows
    from specdec.calibration.head_train.init import initial_head
    from specdec.calibration.head_train.torch_head import TorchHead
    from specdec.native.weights import target_weights
    from specdec.runtime.head_drafter import embedding_table

    entry = manifest.target
    native = target_weights(bundle, entry.native, entry.dims)
    weights, record = initial_head(native, entry.dims, head_feature_layers(entry.dims.num_layers), draft_ids, seed)
    return TorchHead(weights, record, float_rows(embedding_table(bundle, entry))), record


def train_stage(bundle: Path, manifest: Manifest, config: HeadTrainConfig, work: Path, deadline: float | None,
                progress: bool) -> tuple[dict, tuple]:
    """Train the head on work/data; -> (the run's figures, (its weights, its record))."""
    import torch

    from specdec.runtime.backend import default_threads

    torch.manual_seed(config.seed)
    torch.set_num_threads(config.threads or default_threads())
    shards = Shards(work / "data")
    draft_ids = _vocabulary(work, shards, manifest, config.draft_vocab)
    head, record = _head(bundle, manifest, draft_ids, config.seed)
    to_draft = torch.full((manifest.target.dims.vocab_size,), -1, dtype=torch.int64)
    to_draft[torch.from_numpy(draft_ids)] = torch.arange(len(draft_ids))
    plan = TrainPlan(batch_tokens=config.batch_tokens, lr=config.lr, chain_steps=config.chain_steps, seed=config.seed,
                     bf16=config.bf16())
    trainer = Trainer(head, shards, to_draft, plan, work, time.monotonic)
    steps = config.steps or max(1, round(config.epochs * trainer.stream.steps_per_epoch()))
    fit_to = deadline if config.steps is None else None
    started = time.monotonic()
    with _bar(progress, "step", "training", steps) as bar:
        result = trainer.run(steps, fit_to, deadline, config.resume, bar)
    return {"steps": result.steps, "planned": result.total, "epochs": result.epochs, "draft_vocab": len(draft_ids),
            "precision": str(Precision.BF16 if plan.bf16 else Precision.FP32),
            "held_out_agreement": result.held_out.agreement(), "held_out_positions": result.held_out.positions,
            "seconds": time.monotonic() - started}, (head.weights(), record)


def attach(bundle: Path, config: HeadTrainConfig, head: tuple, source: str):
    """Attach the trained head to config.out (a copy of the bundle) or to the bundle, its record's source `source`;
    -> the record written."""
    from specdec.calibration.head_train.pipeline import copy_bundle
    from specdec.head.format import attach_head

    weights, record = head
    record = dataclasses.replace(record, source=source)
    if config.out is None:
        return attach_head(bundle, weights, record)
    written = []
    copy_bundle(bundle, Path(config.out), lambda staged: written.append(attach_head(staged, weights, record)))
    return written[0]
