"""load() and the Generator: a bundle's models behind one run / generate / stream API (no torch, no transformers).

A Generator serves one request at a time (DESIGN §5). `generate` and `run` hold its lock for the whole request,
so concurrent callers are served one after another. A `stream` holds the lock one round at a time: when another
request used the models while a stream was suspended, the stream re-prefills its own tokens before its next
round, so it stays correct. Services with many concurrent users go through specdec.serving.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import numpy as np

from specdec.errors import BackendError, CapacityError, ConfigError
from specdec.manifest import Manifest, check_bundle_files, read_manifest
from specdec.runtime.adaptive_gamma import FixedGamma, HeuristicGamma, adaptive_from_record
from specdec.runtime.config import AUTO_BACKEND, GenerationConfig
from specdec.runtime.drafters import ChainDrafter, ModelDrafter, ModelGate, PromptLookupDrafter
from specdec.runtime.loop import SpeculativeLoop
from specdec.runtime.registry import TrtBackend, open_backends
from specdec.runtime.state import Row, Stats, Timed, row_rng
from specdec.runtime.text import StopStrings, TextCodec, holdback

DEFAULT_ALPHA, DEFAULT_COST = 0.7, 0.5  # priors of sampled requests where the bundle has no γ calibration


@dataclass
class GenerationResult:
    text: str
    token_ids: list  # generated tokens only
    finish_reason: str
    prompt_ids: list
    stats: Stats = field(repr=False)


def load(bundle: str | Path, backend: str = AUTO_BACKEND, device: str | None = None, verify: bool = True,
         threads: int | None = None) -> "Generator":
    """Open a bundle for generation. `verify` checks the sha256 of every file the opened backends and the tokenizer
    read against the manifest (before each is opened).
    backend: "auto" (the default) opens the native backend where the bundle and this machine allow it (native weights
    in the bundle, an AVX2 CPU, a C compiler), else onnxruntime; the Generator's `backend` names the one opened and
    `backend_note` says why native was not (specdec.runtime.registry).
    device: "cpu" for onnxruntime and native (the default), "cuda:N" for tensorrt (default cuda:0)."""
    root = Path(bundle)
    manifest = read_manifest(root)
    if verify:
        check_bundle_files(root, manifest, list(manifest.tokenizer.files))
    device = device or ("cuda:0" if backend == TrtBackend.name else "cpu")
    codec = TextCodec(root).open()
    target, draft, backend, note = open_backends(root, manifest, backend, device, threads, verify)
    generator = Generator(manifest, codec, target, draft)
    generator.backend, generator.backend_note = backend, note
    return generator


@dataclass
class Request:
    """One request in flight: its rows, loop and statistics."""

    rows: list
    loop: SpeculativeLoop
    stats: Stats = field(default_factory=Stats)
    started: float = field(default_factory=time.perf_counter)
    rounds: int = 0


class Generator:
    def __init__(self, manifest: Manifest, codec: TextCodec, target, draft=None):
        self.manifest = manifest
        self.codec = codec
        self.target = Timed(target)
        self.draft = Timed(draft) if draft is not None else None
        self.gate = ModelGate()  # measured α and c of this bundle's draft on this machine (greedy requests)
        self.last_stats: Stats | None = None  # of the latest request
        self._lock = threading.RLock()
        self._owner = None  # the Request whose KV the backends hold
        self._closed = False
        self.backend = target.name  # load() names what it chose
        self.backend_note = None  # why load(backend='auto') did not open the native backend

    # --- request preparation ---------------------------------------------------------------------------
    def _prompt_ids(self, prompt, config: GenerationConfig) -> list:
        if isinstance(prompt, bytes):
            try:
                prompt = prompt.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise ConfigError(f"the prompt is not valid UTF-8 ({exc.reason} at byte {exc.start})",
                                  "pass text, or bytes in UTF-8") from exc
        if isinstance(prompt, str):
            return self._text_ids(prompt, config)
        try:
            ids = [int(t) for t in prompt]
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"the prompt is neither text nor token ids ({type(prompt).__name__})",
                              "pass a string, a list of token ids, or a list of either (a batch)") from exc
        if not ids:
            raise ConfigError("the prompt has no token ids", "pass at least one token id")
        vocab = self.manifest.target.dims.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise ConfigError(f"token id {bad[0]} is outside the vocabulary 0..{vocab - 1}", "check the tokenizer used")
        return ids

    def _text_ids(self, prompt: str, config: GenerationConfig) -> list:
        if not prompt:
            raise ConfigError("the prompt is empty", "pass at least one character or token")
        try:
            prompt.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise ConfigError(f"the prompt holds {prompt[exc.start]!r} at {exc.start}, which is not valid Unicode "
                              "text (a lone surrogate)", "pass valid UTF-8 text") from exc
        return self.codec.chat(prompt) if config.chat else self.codec.encode(prompt)

    def _gamma(self, config: GenerationConfig) -> int:
        defaults = self.manifest.defaults
        gamma = config.gamma or defaults.gamma
        if gamma > defaults.gamma_max:
            raise ConfigError(
                f"gamma {gamma} exceeds this bundle's gamma_max {defaults.gamma_max}",
                f"pass gamma <= {defaults.gamma_max}, or re-export with a larger --gamma-max",
            )
        return gamma

    @property
    def _gamma_record(self):
        """The draft's γ calibration (a GammaRecord), or None."""
        draft = self.manifest.draft
        return draft.calibration.gamma if draft is not None else None

    def default_policy(self, config: GenerationConfig):
        """The γ policy of a request. Adaptive starts from the bundle's γ calibration; without one, greedy requests
        start from what this generator measured (the gate), sampled ones from fixed priors (seeds reproduce)."""
        gamma, gamma_max = self._gamma(config), self.manifest.defaults.gamma_max
        if config.gamma_policy == "heuristic":
            return HeuristicGamma(gamma, gamma_max)
        if config.gamma_policy == "adaptive":
            if config.greedy:
                return adaptive_from_record(self._gamma_record, gamma_max, self.gate.alpha, self.gate.cost_ratio or DEFAULT_COST)
            return adaptive_from_record(self._gamma_record, gamma_max, DEFAULT_ALPHA, DEFAULT_COST)
        return FixedGamma(gamma)

    def _gate(self, config: GenerationConfig) -> ModelGate:
        if config.greedy:
            return self.gate
        record = self._gamma_record
        return ModelGate(cost_ratio=record.cost_ratio if record is not None else DEFAULT_COST)

    def _rows(self, prompts: list, config: GenerationConfig) -> list:
        size, max_batch = self.manifest.target.max_seq_len, self.manifest.target.max_batch
        if not prompts:
            raise ConfigError("the batch is empty", "pass at least one prompt")
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
            rows.append(Row(tokens=ids, prompt_len=len(ids), rng=row_rng(config.seed, index), config=config,
                            slot=index, gate=self._gate(config), noise_key=self._noise_key(config, index)))
        return rows

    @staticmethod
    def _noise_key(config: GenerationConfig, row: int) -> tuple | None:
        if config.greedy or config.coupling != "gumbel":
            return None
        seed = config.seed if config.seed is not None else int(np.random.SeedSequence().generate_state(1)[0])
        return (seed, row)

    def _drafters(self, config: GenerationConfig) -> dict:
        kind = config.drafter
        if kind == "none":
            return {}
        if self.draft is None and kind == "model":
            raise ConfigError("this bundle has no draft model", "use drafter='prompt_lookup' or 'auto', or re-export")
        lookup = PromptLookupDrafter()
        model = None
        if self.draft is not None:
            model = ModelDrafter(self.draft, self.manifest.defaults.max_prefill_chunk, self.gate.observe_draft_step,
                                 kv_source=self.target)
        drafters = {"prompt_lookup": lookup, "model": model, "auto": ChainDrafter(lookup, model)}
        return {kind: drafter for kind, drafter in drafters.items() if drafter is not None}

    def request(self, prompts: list, config: GenerationConfig | None = None, policy=None) -> Request:
        """A Request for `prompts` (texts or token-id lists); `policy` overrides the config's γ policy."""
        config = config or GenerationConfig()
        policy = policy or self.default_policy(config)
        rows = self._rows(list(prompts), config)
        eos = config.eos_token_ids if config.eos_token_ids is not None else self.manifest.tokenizer.eos_token_ids
        loop = SpeculativeLoop(self.target, self._drafters(config), policy, self.manifest.defaults.max_prefill_chunk,
                               eos, StopStrings(self.codec))
        return Request(rows, loop)

    # --- running -----------------------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise BackendError("this Generator is closed", "open the bundle again with specdec.load(...)")

    def _take_models(self, request: Request) -> None:
        """Give the backends to `request`: (re)set its slots and prefill its committed tokens."""
        self.target.reset(len(request.rows))
        if self.draft is not None:
            self.draft.reset(len(request.rows))
        request.stats.prefill_s += request.loop.prefill(request.rows)
        self._owner = request

    def rounds(self, request: Request) -> Iterator:
        """Run `request` round by round, yielding each Round record; its stats are final when this ends."""
        forward_before = self._forward_seconds()
        while any(row.active for row in request.rows):
            with self._lock:
                self._check_open()
                if self._owner is not request:
                    self._take_models(request)
                record = request.loop.step(request.rows)
                request.stats.forward_s += self._forward_seconds() - forward_before
                forward_before = self._forward_seconds()
            request.rounds += 1
            request.stats.observe(record)
            request.stats.total_s = time.perf_counter() - request.started
            if request.rounds == 1:
                request.stats.first_token_s = request.stats.total_s
            self.last_stats = request.stats
            yield record

    def _forward_seconds(self) -> float:
        return self.target.seconds + (self.draft.seconds if self.draft is not None else 0.0)

    def result(self, row: Row, stats: Stats) -> GenerationResult:
        ids = row.tokens[row.prompt_len :]
        text = self.codec.decode(ids)
        if row.finish == "stop":
            text = text[: row.stop_at]
        return GenerationResult(text, ids, row.finish, row.tokens[: row.prompt_len], stats)

    def run(self, prompts: list, config: GenerationConfig | None = None, policy=None) -> list:
        """One request of one or more prompts (a batch), optionally under an explicit γ `policy`;
        -> a GenerationResult per prompt. Serialized with every other user of this generator."""
        with self._lock:
            self._check_open()
            request = self.request(prompts, config, policy)
            for _ in self.rounds(request):
                pass
        return [self.result(row, request.stats) for row in request.rows]

    def generate(self, prompt, config: GenerationConfig | None = None):
        """prompt: text, token ids, or a list of either (a batch). Returns one result, or a list for a batch."""
        batch = isinstance(prompt, (list, tuple)) and len(prompt) > 0 and not isinstance(prompt[0], (int, np.integer))
        results = self.run(list(prompt) if batch else [prompt], config)
        return results if batch else results[0]

    def stream(self, prompt, config: GenerationConfig | None = None) -> Iterator[str]:
        """Yield text pieces of one prompt as tokens are committed; `last_stats` holds the stats afterwards.
        Text that could still become a stop string, or an incomplete UTF-8 sequence, is held back until settled,
        so the pieces add up to generate().text."""
        config = config or GenerationConfig()
        with self._lock:
            self._check_open()
            request = self.request([prompt], config)
        row, shown = request.rows[0], ""
        for _ in self.rounds(request):
            text = self.result(row, request.stats).text
            if row.active:
                text = text[: len(text) - holdback(text, config.stop)]
                if text.endswith("\ufffd"):
                    continue  # an incomplete UTF-8 sequence: wait for the next token
            if len(text) > len(shown):
                yield text[len(shown) :]
                shown = text

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._owner = None
            self.target.backend.close()
            if self.draft is not None:
                self.draft.backend.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
