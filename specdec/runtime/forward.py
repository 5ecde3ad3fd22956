"""What a forward call asks of a backend and what it gives back, what a backend declares it can give, and the one
wrapper that times and meters calls (docs/design.md, "The forward seam").

A backend's `run(ForwardRequest) -> ForwardResult` is the seam; `forward(ids, cache_len, last_only, slots)` is its
logits-only shorthand. A request may ask for more than logits only where the backend's `capabilities` declare it:
nothing is found by probing attributes, and a wrapper passes the capabilities of what it wraps through unchanged.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from enum import StrEnum

import numpy as np

from specdec.errors import BackendError


class Output(StrEnum):
    """What a backend's forward calls can give back beyond logits."""

    LOGITS = "logits"  # [B, T or 1, V]: every backend
    FEATURES = "features"  # [B, T, F, H]: every fed token's hidden state after each requested layer
    GREEDY_CHAIN = "greedy_chain"  # propose_greedy: several greedy one-token steps in one call on the device


@dataclass(frozen=True)
class Capabilities:
    """What a backend declares it returns. feature_layers: the layers whose hidden states it can return, None where
    it can return any of 0..L-1 (the kernel engines); () where it returns none."""

    outputs: frozenset = frozenset({Output.LOGITS})
    feature_layers: tuple | None = ()

    def __contains__(self, output: Output) -> bool:
        return output in self.outputs

    def check(self, request: "ForwardRequest", role: str, backend: str) -> None:
        """BackendError where `request` asks for features this backend does not return."""
        wanted = request.feature_layers
        if not wanted:
            return
        if Output.FEATURES not in self:
            raise BackendError(f"the {role} on the {backend} backend returns no hidden states (asked for layers "
                               f"{list(wanted)})", "use backend='native' or 'cuda', or re-export the bundle with "
                               "--feature-layers so its graph returns them")
        missing = [layer for layer in wanted if self.feature_layers is not None and layer not in self.feature_layers]
        if missing:
            raise BackendError(f"the {role}'s graph returns the hidden states of layers {list(self.feature_layers)}, "
                               f"not {missing}", "re-export the bundle with --feature-layers naming them")


LOGITS_ONLY = Capabilities()


@dataclass(frozen=True)
class ForwardRequest:
    """One forward call: rows of T tokens at their own cache lengths and KV slots."""

    input_ids: np.ndarray  # [B, T] int64
    cache_len: np.ndarray  # [B] int64: each row's committed length, where its new K/V land
    last_only: bool = False  # logits of each row's last position only: [B, 1, V]
    slots: np.ndarray | None = None  # [B] distinct KV slots (default 0..B-1)
    feature_layers: tuple = ()  # layers whose hidden states come back for every fed token


@dataclass(frozen=True)
class ForwardResult:
    logits: object  # [B, T or 1, V] float32 (a device backend's DeviceLogits)
    features: np.ndarray | None = None  # [B, T, F, H] float32, F = len(request.feature_layers); None where not asked


def head_feature_layers(num_layers: int) -> tuple:
    """The three layers whose hidden states an EAGLE-3 head reads (low, middle, high), as the outputs of layers 1,
    L/2 - 1 and L - 4 (the inputs of layers 2, L/2 and L - 3, as vLLM and SGLang count them); fewer where a model
    has too few layers to tell them apart."""
    wanted = (1, num_layers // 2 - 1, num_layers - 4)
    return tuple(sorted({min(max(layer, 0), num_layers - 1) for layer in wanted}))


def feature_order(layers, num_layers: int) -> tuple:
    """A request's layers as a tuple of ints in 0..num_layers-1; BackendError otherwise."""
    chosen = tuple(int(layer) for layer in layers)
    if any(not 0 <= layer < num_layers for layer in chosen):
        raise BackendError(f"feature layers {list(chosen)} fall outside the model's layers 0..{num_layers - 1}",
                           "name layers of the target (a head's config lists the three it reads)")
    return chosen


@dataclass
class Observed:
    """A backend whose calls are timed: `seconds` and `calls` add up, and `observe(width, steps, seconds)`, where
    given, hears of every call. width: the rows the call costs, as the gqa driver runs them (a T = 1 call of several
    rows is one batched run over slots 0..max(slot); a T > 1 call is one run per row). Everything else, its
    capabilities included, is the wrapped backend's."""

    backend: object
    observe: object = None  # callable(width, steps, seconds) or None
    seconds: float = 0.0
    calls: int = 0

    @property
    def capabilities(self) -> Capabilities:
        return self.backend.capabilities

    def run(self, request: ForwardRequest) -> ForwardResult:
        started = time.perf_counter()
        result = self.backend.run(request)
        rows, steps = request.input_ids.shape
        slots = request.slots
        self._count(started, rows if rows == 1 or steps > 1 or slots is None else int(np.max(slots)) + 1, steps)
        return result

    def forward(self, input_ids: np.ndarray, cache_len: np.ndarray, last_only: bool = False, slots=None):
        return self.run(ForwardRequest(input_ids, cache_len, last_only, slots)).logits

    def propose_greedy(self, tokens: np.ndarray, cache_len: np.ndarray, slots: np.ndarray, steps: int) -> np.ndarray:
        """A device backend's chained greedy draft steps (Output.GREEDY_CHAIN), timed as one call; not observed (its
        cost is no one-token step's)."""
        started = time.perf_counter()
        chosen = self.backend.propose_greedy(tokens, cache_len, slots, steps)
        self._count(started)
        return chosen

    def _count(self, started: float, width: int = 0, steps: int = 0) -> None:
        seconds = time.perf_counter() - started
        self.seconds += seconds
        self.calls += 1
        if self.observe is not None and width:
            self.observe(width, steps, seconds)

    def __getattr__(self, name):
        backend = self.__dict__.get("backend")  # absent while a copy is being built: no recursion
        if backend is None or name.startswith("__"):
            raise AttributeError(name)
        return getattr(backend, name)
