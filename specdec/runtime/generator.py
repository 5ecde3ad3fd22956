"""load() and the Generator: a bundle's models behind one run / generate / stream API (no torch, no transformers).

A Generator serves one request at a time (docs/generation.md). `generate` and `run` hold its lock for the whole request,
so concurrent callers are served one after another. A `stream` holds the lock one round at a time: when another
request used the models while a stream was suspended, the stream prefills its own tokens again before its next
round. Its draft then holds the target's KV at every committed position, as it does in an uninterrupted run
(ModelDrafter), and its random stream, γ policy and gate are its own (specdec.runtime.requests), so a seeded
stream gives the tokens of the same request alone. Only the target's KV of the prompt and the accepted tokens is
computed again, in prefill chunks rather than the passes that first computed it: equal to float rounding, which
changes a token only where a sample falls that close to a boundary. Services with many concurrent users go
through specdec.serving.
"""
from __future__ import annotations

import numbers
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import numpy as np

from specdec.errors import BackendError, ConfigError, shown
from specdec.manifest import Manifest, check_bundle_files, read_manifest
from specdec.runtime.backend import cpu_count
from specdec.runtime.config import AUTO_BACKEND, GenerationConfig
from specdec.runtime.drafters import ModelGate
from specdec.runtime.forward import Observed
from specdec.runtime.head_drafter import feature_problem, open_head
from specdec.runtime.loop import SpeculativeLoop
from specdec.runtime.native_backend import checked_activations
from specdec.weights_file import PAGES
from specdec.weight_kinds import Isa
from specdec.runtime.prompt_worker import PromptBudget, PromptWorker
from specdec.runtime.registry import open_backends
from specdec.runtime.requests import RequestLayer
from specdec.runtime.state import Row, Stats
from specdec.runtime.text import StopStrings, TextCodec

THREADS_CAP = 1024  # no forward pass gains from more; a pool of a million threads hangs the process


def max_threads() -> int:
    """The most threads `load(threads=...)` and `serve --threads` accept: 4 × the cores this process may use (more
    only oversubscribes them), and never more than THREADS_CAP."""
    return min(THREADS_CAP, 4 * cpu_count())


def check_threads(threads) -> int | None:
    """`threads` as an int in 1..max_threads(), or None (every core this process may use)."""
    if threads is None:
        return None
    limit = max_threads()
    if isinstance(threads, bool) or not isinstance(threads, numbers.Integral) or not 1 <= threads <= limit:
        raise ConfigError(f"threads={threads!r} is outside 1..{limit} (4 × the {cpu_count()} cores this process may "
                          f"use, at most {THREADS_CAP})",
                          "leave threads unset (every core this process may use), or pass a count in that range")
    return int(threads)


def checked_config(config) -> GenerationConfig:
    """A request's GenerationConfig (None: the defaults); anything else, a dict of options included, is refused."""
    if config is None:
        return GenerationConfig()
    if not isinstance(config, GenerationConfig):
        raise ConfigError(f"config must be a GenerationConfig or None, not {type(config).__name__}: "
                          f"{shown(config)}", "pass GenerationConfig(...): for a dict of options, "
                          "specdec.GenerationConfig(**options)")
    return config


@dataclass
class GenerationResult:
    text: str
    token_ids: list  # generated tokens only
    finish_reason: str
    prompt_ids: list
    stats: Stats = field(repr=False)


def load(bundle: str | os.PathLike, backend: str = AUTO_BACKEND, device: str | None = None, verify: bool = True,
         threads: int | None = None, prompt_budget: PromptBudget | None = None,
         activations: str | None = None, pages: str | None = None, isa: str | None = None) -> "Generator":
    """Open a bundle for generation. `verify` checks the sha256 of every file the opened backends and the tokenizer
    read against the manifest (before each is opened).
    backend: "auto" (the default) opens the cuda backend on a GPU, else the native backend where the bundle and this
    machine allow it (native weights in the bundle, an AVX2 CPU, a C compiler), else onnxruntime; the Generator's `backend` names the one opened and
    `backend_note` says why native was not (specdec.runtime.registry).
    device: "cpu" for onnxruntime and native, "cuda:N" for cuda and tensorrt (their default cuda:0); unset with
    backend="auto": a GPU where CuPy sees one (the cuda backend), else the CPU.
    prompt_budget: what rendering one chat prompt may cost (time, memory) in the Generator's prompt worker.
    activations: the native target's, "fp32", "int8" (each row's rounded per block of 32 before every product with
    blocked weights) or "bf16" (rounded to bf16 before every product with bf16 rows, on AMX-BF16 tiles; CPUs with
    AMX): docs/backends.md; unset, the bundle's defaults.activations (fp32 where it has none). int8 and bf16 run on
    the native backend only (another backend asked for them: ConfigError); the Generator's `activations` says which
    ran.
    pages, isa: the native backend's: how it holds its weights ("private", the default: a copy on huge pages; or
    "shared": the bundle's file mapped, one copy for every process), and its kernels' instruction set ("auto", the
    default: the widest this CPU runs; "avx2", "avx2-vnni", "avx512", "avx512-vbmi"); unset, $SPECDEC_NATIVE_PAGES and
    $SPECDEC_NATIVE_ISA, where set, else those defaults."""
    threads = check_threads(threads)
    activations = None if activations is None else checked_activations(activations)
    _check_choice("pages", pages, PAGES)
    _check_choice("isa", isa, tuple(Isa))
    _check_type("backend", backend, str, "pass backend='auto' (the default), 'onnxruntime', 'native', 'cuda' or "
                                         "'tensorrt'")
    _check_type("device", device, (str, type(None)), "pass device='cpu' or 'cuda:N', or leave it unset")
    _check_type("verify", verify, bool, "pass verify=True (the default) or False")
    return generator_of(bundle, verify, lambda root, manifest: open_backends(root, manifest, backend, device,
                                                                            threads, verify, activations, pages, isa),
                        prompt_budget)


def _check_choice(name: str, value, choices: tuple) -> None:
    if value is not None and value not in choices:
        raise ConfigError(f"{name}={shown(value)} is not one of {', '.join(choices)}",
                          f"pass {name}= one of those, or leave it unset (docs/backends.md)")


def _check_type(name: str, value, kinds, hint: str) -> None:
    if not isinstance(value, kinds):
        expected = "a str or None" if isinstance(kinds, tuple) else f"a {kinds.__name__}"
        raise ConfigError(f"{name} must be {expected}, not {type(value).__name__}: {shown(value)}", hint)


def bundle_path(bundle) -> Path:
    """The bundle's directory from a str or os.PathLike; bytes (a path in no known encoding) and anything else are
    refused with a hint."""
    hint = "pass the bundle's directory as a str or pathlib.Path, e.g. specdec.load('bundles/smollm2-q41')"
    try:
        path = os.fspath(bundle)
    except TypeError:
        raise ConfigError(f"the bundle must be a path (str or os.PathLike), not {type(bundle).__name__}: "
                          f"{shown(bundle)}", hint) from None
    if isinstance(path, bytes):
        raise ConfigError(f"the bundle path must be text, not bytes: {shown(path)}",
                          "decode it first: specdec.load(os.fsdecode(path))")
    if not path or "\0" in path:
        raise ConfigError(f"the bundle path {shown(path)} is empty or holds a NUL character", hint)
    return Path(path)


def generator_of(bundle: str | os.PathLike, verify: bool, open_models,
                 prompt_budget: PromptBudget | None = None) -> "Generator":
    """A Generator of the bundle's models as `open_models(root, manifest)` opens them -> (target, draft, backend's
    name, note); the tokenizer's files hashed first where `verify`."""
    root = bundle_path(bundle)
    if prompt_budget is not None and not isinstance(prompt_budget, PromptBudget):
        raise ConfigError(f"prompt_budget must be a PromptBudget or None, not {type(prompt_budget).__name__}",
                          "pass specdec.runtime.prompt_worker.PromptBudget(timeout_s=..., memory_mb=...)")
    manifest = read_manifest(root)
    if verify:
        check_bundle_files(root, manifest, TextCodec.files_read(root))
    codec = TextCodec(root).open()
    target, draft, backend, note = open_models(root, manifest)
    try:
        head = open_head(root, manifest, target, verify)
    except BaseException:
        target.close()
        if draft is not None:
            draft.close()
        raise
    generator = Generator(manifest, codec, target, draft, prompt_budget, head)
    generator.backend, generator.backend_note = backend, note
    return generator


def load_cuda(bundle: str | Path, options=None, verify: bool = True) -> "Generator":
    """specdec.load(bundle, backend="cuda") with options of the caller's: graphs off (to measure what they buy), or
    the numpy reference kernels standing in for the GPU's (tests)."""
    from specdec.runtime.cuda_backend import CudaBackend, CudaOptions
    from specdec.runtime.registry import open_pair

    options = options or CudaOptions()

    def open_models(root, manifest):
        target = CudaBackend(root, manifest.target, options)
        return (*open_pair(CudaBackend, root, manifest, f"cuda:{options.device}", None, verify, target),
                CudaBackend.name, None)

    return generator_of(bundle, verify, open_models)


@dataclass
class Request:
    """One request in flight: its rows, loop and statistics."""

    rows: list
    loop: SpeculativeLoop
    stats: Stats = field(default_factory=Stats)
    started: float = field(default_factory=time.perf_counter)
    rounds: int = 0


class Generator:
    def __init__(self, manifest: Manifest, codec: TextCodec, target, draft=None,
                 prompt_budget: PromptBudget | None = None, head=None):
        self.manifest = manifest
        self.codec = codec
        self.target = Observed(target)
        self.draft = Observed(draft) if draft is not None else None
        self.head = head  # the bundle's draft head (specdec.head.model.HeadModel), or None
        self.gate = ModelGate()  # measured α and c of this bundle's draft on this machine (greedy requests)
        self.prompt_worker = PromptWorker(codec.root, prompt_budget)  # renders chat prompts (started at the first)
        self.requests = RequestLayer(manifest, codec, self.gate, has_draft=draft is not None,
                                     prompts=self.prompt_worker, head=head,
                                     head_problem=None if head is None else feature_problem(head, self.target))
        self.last_stats: Stats | None = None  # of the latest request
        self._lock = threading.RLock()
        self._owner = None  # the Request whose KV the backends hold
        self._closed = False
        self.backend = target.name  # load() names what it chose
        self.backend_note = None  # why load(backend='auto') did not open the native backend
        self.activations = target.activations  # the target's: fp32, int8 or bf16 (the native backend's option)

    # --- request preparation: specdec.runtime.requests ---------------------------------------------------------
    def default_policy(self, config: GenerationConfig):
        """The γ policy a request gets unless told otherwise (RequestLayer.policy)."""
        return self.requests.policy(config)

    def request(self, prompts: list, config: GenerationConfig | None = None, policy=None) -> Request:
        """A Request for `prompts` (texts or token-id lists) with its effective options (the bundle's defaults where
        the config leaves them unset: RequestLayer.config); `policy` overrides the config's γ policy."""
        config = self.requests.config(checked_config(config))
        if not isinstance(prompts, (list, tuple)):
            raise ConfigError(f"prompts must be a list of prompts, not {type(prompts).__name__}: {shown(prompts)}",
                              "pass a list: generator.run(['Hello', 'Hi'])")
        rows = self.requests.rows(list(prompts), config)
        policy = policy or self.requests.policy(config)
        loop = SpeculativeLoop(self.target, self.requests.drafters(self.draft, self.target), policy,
                               self.manifest.defaults.max_prefill_chunk, self.requests.eos_ids(config),
                               StopStrings(self.codec))
        return Request(rows, loop)

    # --- running -----------------------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise BackendError("this Generator is closed", "open the bundle again with specdec.load(...)")

    def _take_models(self, request: Request):
        """Give the backends to `request`: (re)set its slots and prefill its committed tokens; -> the Round of its
        rows' first tokens (a new request's prefill gives them), or None."""
        self.target.reset(len(request.rows))
        if self.draft is not None:
            self.draft.reset(len(request.rows))
        seconds, first = request.loop.prefill(request.rows)
        request.stats.prefill_s += seconds
        self._owner = request
        return first

    def rounds(self, request: Request) -> Iterator:
        """Run `request` round by round, yielding each Round record; its stats are final when this ends."""
        forward_before = self._forward_seconds()
        while any(row.active for row in request.rows):
            with self._lock:
                self._check_open()
                record = self._take_models(request) if self._owner is not request else None
                record = record or request.loop.step(request.rows)
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
        return GenerationResult(self.requests.text(row), row.tokens[row.prompt_len :], row.finish,
                                row.tokens[: row.prompt_len], stats)

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
        so the pieces add up to generate().text. A config of the wrong type is refused here, not at the first piece."""
        return self._stream(prompt, checked_config(config))

    def _stream(self, prompt, config: GenerationConfig) -> Iterator[str]:
        with self._lock:
            self._check_open()
            request = self.request([prompt], config)
        row, shown = request.rows[0], ""
        for _ in self.rounds(request):
            text = self.requests.text(row)
            if len(text) > len(shown):
                yield text[len(shown) :]
                shown = text

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._owner = None
            self.prompt_worker.close()
            self.target.backend.close()
            if self.draft is not None:
                self.draft.backend.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
