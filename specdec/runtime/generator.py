"""load() and the Generator: a bundle's models behind one generate / stream API (no torch, no transformers)."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import numpy as np

from specdec.errors import BackendError, CapacityError, ConfigError
from specdec.manifest import Manifest, check_bundle_files, read_manifest
from specdec.runtime.adaptive_gamma import FixedGamma, HeuristicGamma, adaptive_from_record
from specdec.runtime.backend import OrtBackend
from specdec.runtime.config import GenerationConfig
from specdec.runtime.drafters import ChainDrafter, ModelDrafter, ModelGate, PromptLookupDrafter
from specdec.runtime.loop import SpeculativeLoop
from specdec.runtime.ort_gqa_backend import OrtGqaBackend
from specdec.runtime.state import Row, Stats, Timed
from specdec.runtime.text import TextCodec


@dataclass
class GenerationResult:
    text: str
    token_ids: list  # generated tokens only
    finish_reason: str
    prompt_ids: list
    stats: Stats = field(repr=False)


def load(bundle: str | Path, backend: str = "onnxruntime", device: str = "cpu", verify: bool = True,
         threads: int | None = None) -> "Generator":
    """Open a bundle for generation. `verify` checks every file's sha256 against the manifest."""
    root = Path(bundle)
    manifest = read_manifest(root)
    if verify:
        check_bundle_files(root, manifest)
    if backend == "tensorrt":
        target, draft = _tensorrt_backends(root, manifest, device, threads)
    elif backend == "onnxruntime" and device == "cpu":
        target = ort_backend_for(root, manifest.target, threads)
        draft = ort_backend_for(root, manifest.draft, threads) if manifest.draft is not None else None
    else:
        raise BackendError(
            f"backend={backend!r}, device={device!r} is not available",
            "use backend='onnxruntime' with device='cpu', or backend='tensorrt' with device='cuda:N'",
        )
    return Generator(manifest, TextCodec(root).open(), target, draft)


def ort_backend_for(root: Path, entry, threads: int | None):
    """The onnxruntime backend that runs this entry's lowering."""
    backend = OrtGqaBackend if entry.lowering == "gqa" else OrtBackend
    return backend(root, entry, threads).open()


def _tensorrt_backends(root: Path, manifest: Manifest, device: str, threads: int | None):
    """TensorRT plans for the models that have one; a draft without a plan (INT4 MatMulNBits) runs on ORT CPU."""
    from specdec.runtime.trt_backend import TrtBackend, TrtOptions

    options = TrtOptions(device=int(device.split(":")[1]) if device.startswith("cuda:") else 0)
    target = TrtBackend(root, manifest.target, options).open()
    draft = manifest.draft
    if draft is None:
        return target, None
    if draft.engines:
        return target, TrtBackend(root, draft, options).open()
    return target, ort_backend_for(root, draft, threads)


class Generator:
    def __init__(self, manifest: Manifest, codec: TextCodec, target, draft=None):
        self.manifest = manifest
        self.codec = codec
        self.target = Timed(target)
        self.draft = Timed(draft) if draft is not None else None
        self.gate = ModelGate()  # measured α and c of this bundle's draft on this machine
        self.last_stats: Stats | None = None  # of the latest stream()

    # --- request preparation ---------------------------------------------------------------------
    def _prompt_ids(self, prompt, config: GenerationConfig) -> list:
        if isinstance(prompt, str):
            if not prompt:
                raise ConfigError("the prompt is empty", "pass at least one character or token")
            return self.codec.chat(prompt) if config.chat else self.codec.encode(prompt)
        ids = [int(t) for t in prompt]
        if not ids:
            raise ConfigError("the prompt has no token ids", "pass at least one token id")
        vocab = self.manifest.target.dims.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise ConfigError(f"token id {bad[0]} is outside the vocabulary 0..{vocab - 1}", "check the tokenizer used")
        return ids

    def _gamma(self, config: GenerationConfig) -> int:
        defaults = self.manifest.defaults
        gamma = config.gamma or defaults.gamma
        if gamma > defaults.gamma_max:
            raise ConfigError(
                f"gamma {gamma} exceeds this bundle's gamma_max {defaults.gamma_max}",
                f"pass gamma <= {defaults.gamma_max}, or re-export with a larger --gamma-max",
            )
        return gamma

    def _rows(self, prompts: list, config: GenerationConfig) -> list:
        size, max_batch = self.manifest.target.max_seq_len, self.manifest.target.max_batch
        if len(prompts) > max_batch:
            raise CapacityError(f"batch of {len(prompts)} exceeds max_batch {max_batch}", "split the batch or re-export")
        rows = []
        for index, prompt in enumerate(prompts):
            ids = self._prompt_ids(prompt, config)
            if len(ids) > size:
                raise CapacityError(
                    f"prompt {index} has {len(ids)} tokens; the bundle's max_seq_len is {size}",
                    "shorten the prompt or re-export with a larger --max-seq-len",
                )
            seed = None if config.seed is None else config.seed + index
            rows.append(Row(tokens=ids, prompt_len=len(ids), rng=np.random.default_rng(seed)))
        return rows

    def _policy(self, config: GenerationConfig, gamma: int):
        """The γ policy of a request; adaptive starts from the bundle's γ calibration when it has one."""
        gamma_max = self.manifest.defaults.gamma_max
        if config.gamma_policy == "heuristic":
            return HeuristicGamma(gamma, gamma_max)
        if config.gamma_policy == "adaptive":
            # prior: the bundle's γ calibration, else what this generator has measured so far (the gate)
            record = self.manifest.draft.calibration.get("gamma", {}) if self.manifest.draft is not None else {}
            return adaptive_from_record(record, gamma_max, self.gate.alpha, self.gate.cost_ratio or 0.5)
        return FixedGamma(gamma)

    def _drafter(self, config: GenerationConfig, policy):
        kind = config.drafter
        if kind == "none":
            return None, None
        lookup = PromptLookupDrafter(config)
        if kind == "prompt_lookup":
            return lookup, None
        if self.draft is None and kind == "model":
            raise ConfigError("this bundle has no draft model", "use drafter='prompt_lookup' or 'auto', or re-export")
        chunk = self.manifest.defaults.max_prefill_chunk
        model = ModelDrafter(self.draft, config, chunk, self.gate) if self.draft is not None else None
        if kind == "model":
            return model, self.gate  # model rounds teach the gate too
        return ChainDrafter(lookup, model, self.gate, policy), self.gate

    # --- running ---------------------------------------------------------------------------------
    def _start(self, prompts: list, config: GenerationConfig):
        policy = self._policy(config, self._gamma(config))
        rows = self._rows(prompts, config)
        drafter, gate = self._drafter(config, policy)
        self.target.reset(len(rows))
        if self.draft is not None:
            self.draft.reset(len(rows))
        eos = config.eos_token_ids if config.eos_token_ids is not None else self.manifest.tokenizer.eos_token_ids
        loop = SpeculativeLoop(self.target, drafter, config, policy, self.manifest.defaults.max_prefill_chunk, eos, gate)
        return loop, rows

    def _rounds(self, prompts: list, config: GenerationConfig) -> Iterator[tuple]:
        """Yield (loop, rows, committed per row) after every round; stats are final when it ends."""
        loop, rows = self._start(prompts, config)
        forward_before = self._forward_seconds()
        started = time.perf_counter()
        loop.prefill(rows)
        first = True
        while any(not row.finish for row in rows):
            committed = loop.step(rows)
            if first:
                loop.stats.first_token_s = time.perf_counter() - started
                first = False
            if config.stop:
                self._apply_stop_strings(rows, committed, config.stop)
            loop.stats.total_s = time.perf_counter() - started
            loop.stats.forward_s = self._forward_seconds() - forward_before
            yield loop, rows, committed

    def _forward_seconds(self) -> float:
        return self.target.seconds + (self.draft.seconds if self.draft is not None else 0.0)

    def _apply_stop_strings(self, rows: list, committed: list, stops: tuple) -> None:
        for row, new in zip(rows, committed):
            if not new:
                continue
            text = self.codec.decode(row.tokens[row.prompt_len :])
            if any(s in text for s in stops):
                # keep the shortest prefix of tokens whose text contains a stop string
                for end in range(row.prompt_len + 1, len(row.tokens) + 1):
                    if any(s in self.codec.decode(row.tokens[row.prompt_len : end]) for s in stops):
                        del row.tokens[end:]
                        break
                row.finish = "stop"

    def _result(self, row: Row, stats: Stats, stops: tuple) -> GenerationResult:
        ids = row.tokens[row.prompt_len :]
        text = self.codec.decode(ids)
        if row.finish == "stop":
            cut = min((text.find(s) for s in stops if s in text), default=len(text))
            text = text[:cut]
        return GenerationResult(text, ids, row.finish, row.tokens[: row.prompt_len], stats)

    def generate(self, prompt, config: GenerationConfig | None = None):
        """prompt: text, token ids, or a list of either (a batch). Returns one result, or a list for a batch."""
        config = config or GenerationConfig()
        batch = isinstance(prompt, (list, tuple)) and prompt and not isinstance(prompt[0], (int, np.integer))
        prompts = list(prompt) if batch else [prompt]
        loop = rows = None
        for loop, rows, _ in self._rounds(prompts, config):
            pass
        results = [self._result(row, loop.stats, config.stop) for row in rows]
        return results if batch else results[0]

    def stream(self, prompt, config: GenerationConfig | None = None) -> Iterator[str]:
        """Yield text pieces of one prompt as tokens are committed; `last_stats` holds the stats afterwards."""
        config = config or GenerationConfig()
        shown = ""
        for loop, rows, _ in self._rounds([prompt], config):
            row = rows[0]
            text = self._result(row, loop.stats, config.stop).text
            if row.finish is None and text.endswith("\ufffd"):
                continue  # an incomplete UTF-8 sequence: wait for the next token
            if len(text) > len(shown):
                yield text[len(shown) :]
                shown = text
            self.last_stats = loop.stats

    def close(self) -> None:
        self.target.backend.close()
        if self.draft is not None:
            self.draft.backend.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
