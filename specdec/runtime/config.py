"""GenerationConfig: the options of one request, checked once (the request layer, specdec.runtime.requests, checks
what needs the bundle: γ against γ_max, the prompt against the vocabulary and S)."""
from __future__ import annotations

import math
import numbers
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Callable

from specdec.errors import CapacityError, ConfigError, shown
from specdec.runtime.adaptive_gamma import GAMMA_POLICY_KINDS, GammaPolicyName


class BackendName(StrEnum):
    """A `backend=` value of specdec.load (specdec.runtime.registry.BACKENDS holds the classes)."""

    AUTO = "auto"  # cuda on a GPU; on the CPU native where the bundle and machine allow it, else onnxruntime
    ONNXRUNTIME = "onnxruntime"
    NATIVE = "native"
    CUDA = "cuda"
    TENSORRT = "tensorrt"


class Device(StrEnum):
    """The kind of device a backend runs on: a `device=` value is "cpu" or "cuda:N"."""

    CPU = "cpu"
    CUDA = "cuda"


class Coupling(StrEnum):
    """How a sampled token is drawn and verified (specdec.runtime.sampling)."""

    LEVIATHAN = "leviathan"
    GUMBEL = "gumbel"


class DrafterName(StrEnum):
    """A `drafter=` value, and the drafter a round's drafts for a row came from (Proposal.source, RowRound.source:
    MODEL, PROMPT_LOOKUP, or NONE for no drafts; an AUTO row's come from one of the first two). DRAFTER_KINDS maps
    each to its DrafterKind, what it builds. Two other draft names mean something else: an export's DraftOrigin
    (specdec.export.config: how specdec-export makes a bundle's draft model) and a draft model's quantization Method
    (specdec.manifest, ModelEntry.derived: the native engine runs an INT4_Q41 draft beside its target)."""

    AUTO = "auto"  # prompt lookup, else the model where it pays
    MODEL = "model"
    PROMPT_LOOKUP = "prompt_lookup"
    NONE = "none"
    HEAD = "head"  # a trained draft head (EAGLE-3 style) over the target's hidden states; `auto` never picks it


AUTO_BACKEND = BackendName.AUTO  # the default of every backend= option
# The choices as plain strings: argparse, pydantic and messages print them (a member's repr is not its value)
NAMED_CPU_BACKENDS = (BackendName.ONNXRUNTIME.value, BackendName.NATIVE.value)
NAMED_BACKENDS = (*NAMED_CPU_BACKENDS, BackendName.CUDA.value)  # what a benchmark measures (one backend, by name)
BACKEND_CHOICES = (AUTO_BACKEND.value, *NAMED_BACKENDS)  # what the CLI and the server offer: tensorrt runs through
# specdec.load(backend="tensorrt", device="cuda:N")
GAMMA_POLICIES = tuple(name.value for name in GAMMA_POLICY_KINDS)
COUPLINGS = tuple(coupling.value for coupling in Coupling)


@dataclass(frozen=True)
class DrafterKind:
    """One `drafter=` choice. `build(drafters, lookup, model, head)` makes its drafter from the module
    specdec.runtime.drafters (handed in: that module imports this one), a generator's prompt-lookup drafter, its
    model drafter (None without a draft model) and its head drafter (None without a draft head); it returns None where
    rows of this kind are never drafted for."""

    name: DrafterName
    build: Callable
    needs_model: bool = False  # refused on a bundle without a draft model
    drafts: bool = True  # False: rows of this kind verify one token per round
    needs_head: bool = False  # refused on a bundle without a draft head


DRAFTER_KINDS = {kind.name: kind for kind in (
    DrafterKind(DrafterName.AUTO, lambda drafters, lookup, model, head: drafters.ChainDrafter(lookup, model, head)),
    DrafterKind(DrafterName.MODEL, lambda drafters, lookup, model, head: model, needs_model=True),
    DrafterKind(DrafterName.PROMPT_LOOKUP, lambda drafters, lookup, model, head: lookup),
    DrafterKind(DrafterName.NONE, lambda drafters, lookup, model, head: None, drafts=False),
    DrafterKind(DrafterName.HEAD, lambda drafters, lookup, model, head: head, needs_head=True),
)}
DRAFTERS = tuple(name.value for name in DRAFTER_KINDS)


class RequestRefusal:
    """What a refused request broke, in two forms: the message names the value seen (for the library's caller);
    `public` states only the rule, `option` the option and `code` a short error code, so a server can answer its
    client without echoing what the client sent."""

    def __init__(self, message: str, hint: str | None, public: str, option: str | None = None,
                 code: str | None = None):
        super().__init__(message, hint)
        self.public = public
        self.option = option
        self.code = code


class OptionError(RequestRefusal, ConfigError):
    """A request option breaks its rule."""


class RequestCapacityError(RequestRefusal, CapacityError):
    """A request does not fit the bundle's static buffers (its prompt, its batch)."""


def checked_int(name: str, value, minimum: int, hint: str) -> int:
    """`value` as a Python int >= minimum; numpy integers are integers, bools are not."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
        raise OptionError(f"{name} must be an integer >= {minimum}, got {shown(value)}", hint,
                          f"{name} must be an integer >= {minimum}", name)
    return int(value)


def _real(name: str, value, rule: str, hint: str) -> float:
    """`value` as a finite Python float; numpy floats and integers are numbers, bools are not."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise OptionError(f"{name} must be {rule}, got {shown(value)}", hint, f"{name} must be {rule}", name)
    return float(value)


def _member(name: str, value, kinds: type[StrEnum]) -> StrEnum:
    """`value`, a member of `kinds` or its string, as the member."""
    if not isinstance(value, str) or value not in tuple(kinds):
        raise OptionError(f"{name} {shown(value)} is unknown", f"choose one of {', '.join(kinds)}",
                          f"{name} is unknown", name)
    return kinds(value)


INT_OPTIONS = (  # (name, minimum, whether None is allowed, hint) of the integer options
    ("max_new_tokens", 1, False, "pass max_new_tokens=1 or more"),
    ("top_k", 0, True, "use 0 to turn top-k off, or None for the bundle's default"),
    ("seed", 0, True, "pass a seed >= 0, or None for fresh randomness"),
    ("gamma", 1, True, "pass gamma=1 or more, or None for the default"),
    ("lookup_ngram", 1, False, "use lookup_ngram=3"),
    ("lookup_min_ngram", 1, False, "use lookup_min_ngram=2"),
)


BUNDLE_DEFAULTS = ("temperature", "top_k", "top_p")  # options None leaves to the manifest's defaults (same names)


@dataclass(frozen=True)
class GenerationConfig:
    """The options of one request. None leaves an option to the bundle: temperature, top_k and top_p take the
    manifest's defaults (the request layer fills them in: RequestLayer.config), γ the bundle's (its γ policy's),
    eos_token_ids the bundle's EOS ids. A value passed is kept, whatever it is (temperature=0 is greedy on a bundle
    whose default samples)."""

    max_new_tokens: int = 128
    temperature: float | None = None  # None: the bundle's default (greedy unless its manifest says so); 0: greedy
    top_k: int | None = None  # None: the bundle's default; 0: off
    top_p: float | None = None  # None: the bundle's default; 1: off
    seed: int | None = None
    gamma: int | None = None  # None: the bundle's calibrated default
    gamma_policy: GammaPolicyName = GammaPolicyName.FIXED  # ADAPTIVE: from running per-position acceptance;
    # HEURISTIC: HF's +2/-1
    drafter: DrafterName = DrafterName.AUTO  # a key of DRAFTER_KINDS
    stop: tuple = ()  # stop strings (one string is one stop string)
    eos_token_ids: tuple | None = None  # None: the bundle's EOS ids
    chat: bool = False  # wrap a text prompt in the bundle's chat template
    lookup_ngram: int = 3  # longest n-gram prompt lookup tries to match
    lookup_min_ngram: int = 2  # shortest; a 1-token match proposes mostly wrong drafts
    coupling: Coupling = Coupling.LEVIATHAN  # GUMBEL: noise fixed by (seed, row, position); output independent of
    # drafter and γ

    def __post_init__(self):
        self._set("stop", _stops(self.stop))
        for name, minimum, optional, hint in INT_OPTIONS:
            if not (optional and getattr(self, name) is None):
                self._set(name, checked_int(name, getattr(self, name), minimum, hint))
        self._check_sampling()
        self._set("gamma_policy", _member("gamma_policy", self.gamma_policy, GammaPolicyName))
        self._set("coupling", _member("coupling", self.coupling, Coupling))
        self._set("drafter", _member("drafter", self.drafter, DrafterName))
        if self.lookup_min_ngram > self.lookup_ngram:
            raise OptionError(
                f"need 1 <= lookup_min_ngram <= lookup_ngram, got {self.lookup_min_ngram} and {self.lookup_ngram}",
                "use lookup_min_ngram=2, lookup_ngram=3", "need 1 <= lookup_min_ngram <= lookup_ngram", "lookup_ngram")
        self._check_eos()
        if not isinstance(self.chat, bool):
            raise OptionError(f"chat must be True or False, got {shown(self.chat)}",
                              "pass chat=True to use the chat template", "chat must be true or false", "chat")

    def _set(self, name: str, value) -> None:
        object.__setattr__(self, name, value)

    def _check_sampling(self) -> None:
        """temperature and top_p, where set (None: the bundle's default, checked when the bundle was read)."""
        if self.temperature is not None:
            hint = "use 0 for greedy decoding, or None for the bundle's default"
            self._set("temperature", _real("temperature", self.temperature, "a finite number", hint))
            if self.temperature < 0:
                raise OptionError(f"temperature must be >= 0, got {self.temperature}", hint,
                                  "temperature must be >= 0", "temperature")
        if self.top_p is not None:
            rule, hint = "in (0, 1]", "use 1.0 to turn top-p off, or None for the bundle's default"
            self._set("top_p", _real("top_p", self.top_p, rule, hint))
            if not 0 < self.top_p <= 1:
                raise OptionError(f"top_p must be {rule}, got {self.top_p!r}", hint, f"top_p must be {rule}", "top_p")

    def _check_eos(self) -> None:
        if self.eos_token_ids is None:
            return
        try:
            if isinstance(self.eos_token_ids, (str, bytes, Mapping)):
                raise TypeError(type(self.eos_token_ids).__name__)
            tokens = tuple(self.eos_token_ids)
        except TypeError:
            raise OptionError(f"eos_token_ids must be a list of token ids, got {shown(self.eos_token_ids)}",
                              "pass token ids of the bundle's vocabulary", "eos_token_ids must be a list of token ids",
                              "eos_token_ids") from None
        hint = "pass token ids of the bundle's vocabulary"
        self._set("eos_token_ids", tuple(checked_int("an eos_token_id", token, 0, hint) for token in tokens))

    @property
    def unset(self) -> tuple:
        """The options left to the bundle's defaults (None): names of BUNDLE_DEFAULTS."""
        return tuple(name for name in BUNDLE_DEFAULTS if getattr(self, name) is None)

    @property
    def greedy(self) -> bool:
        """Whether the request decodes greedily: a question for its effective options (RequestLayer.config), since
        an unset temperature is the bundle's."""
        if self.temperature is None:
            raise ConfigError("this GenerationConfig leaves temperature to the bundle (None), so whether it is greedy "
                              "depends on the bundle", "ask the bundle's request layer for the effective options: "
                              "generator.requests.config(config)")
        return self.temperature == 0

    @property
    def gumbel(self) -> bool:
        """Whether draft and target take their tokens from the same Gumbel noise (Coupling.GUMBEL)."""
        return self.coupling == Coupling.GUMBEL

    @property
    def seeded_sample(self) -> bool:
        """A sampled request with a seed: its tokens must not depend on anything but the request (docs/generation.md)."""
        return not self.greedy and self.seed is not None

    @property
    def drafter_kind(self) -> DrafterKind:
        return DRAFTER_KINDS[self.drafter]

    @property
    def gamma_policy_kind(self):
        """The PolicyKind of `gamma_policy` (specdec.runtime.adaptive_gamma.GAMMA_POLICY_KINDS)."""
        return GAMMA_POLICY_KINDS[self.gamma_policy]


def _stops(stop) -> tuple:
    """A tuple of non-empty stop strings; a lone string is one stop string (not one per character)."""
    stops = (stop,) if isinstance(stop, str) else stop
    try:
        if isinstance(stop, (bytes, bytearray, Mapping)):
            raise TypeError(type(stop).__name__)
        stops = tuple(stops)
    except TypeError:
        raise OptionError(f"stop must be a string or a list of strings, got {shown(stop)}", "pass stop=['###']",
                          "stop must be a string or a list of strings", "stop") from None
    for item in stops:
        if not isinstance(item, str) or not item:
            raise OptionError(f"stop strings must be non-empty strings, got {shown(item)}", "drop empty stop strings",
                              "stop strings must be non-empty strings", "stop")
        try:
            item.encode("utf-8")
        except UnicodeEncodeError:
            raise OptionError(f"stop string {shown(item)} is not valid Unicode text", "pass valid UTF-8 text",
                              "a stop string is not valid Unicode text (a lone surrogate)", "stop") from None
    return stops
