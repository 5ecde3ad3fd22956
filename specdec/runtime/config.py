"""GenerationConfig: the options of one request, checked once."""
from __future__ import annotations

import math
from dataclasses import dataclass

from specdec.errors import ConfigError

DRAFTERS = ("auto", "model", "prompt_lookup", "none")
AUTO_BACKEND = "auto"  # the native backend where the bundle and this machine allow it, else onnxruntime
NAMED_CPU_BACKENDS = ("onnxruntime", "native")  # what a benchmark measures (one backend, by name)
CPU_BACKENDS = (AUTO_BACKEND, *NAMED_CPU_BACKENDS)  # what the CLI offers: tensorrt runs through
# specdec.load(backend="tensorrt", device="cuda:N")
GAMMA_POLICIES = ("fixed", "adaptive", "heuristic")
COUPLINGS = ("leviathan", "gumbel")  # how a sampled token is drawn and verified (specdec.runtime.sampling)


@dataclass(frozen=True)
class GenerationConfig:
    max_new_tokens: int = 128
    temperature: float = 0.0  # 0: greedy
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1: off
    seed: int | None = None
    gamma: int | None = None  # None: the bundle's calibrated default
    gamma_policy: str = "fixed"  # "adaptive": from running per-position acceptance; "heuristic": HF's +2/-1
    drafter: str = "auto"
    stop: tuple = ()  # stop strings (one string is one stop string)
    eos_token_ids: tuple | None = None  # None: the bundle's EOS ids
    chat: bool = False  # wrap a text prompt in the bundle's chat template
    lookup_ngram: int = 3  # longest n-gram prompt lookup tries to match
    lookup_min_ngram: int = 2  # shortest; a 1-token match proposes mostly wrong drafts
    coupling: str = "leviathan"  # "gumbel": noise fixed by (seed, row, position); output independent of drafter and γ

    def __post_init__(self):
        object.__setattr__(self, "stop", _stops(self.stop))
        _int("max_new_tokens", self.max_new_tokens, 1, "pass max_new_tokens=1 or more")
        temperature = self.temperature
        if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not math.isfinite(temperature):
            raise ConfigError(f"temperature must be a finite number, got {temperature!r}", "use 0 for greedy decoding")
        if temperature < 0:
            raise ConfigError(f"temperature must be >= 0, got {temperature}", "use 0 for greedy decoding")
        top_p = self.top_p
        if isinstance(top_p, bool) or not isinstance(top_p, (int, float)) or not 0 < top_p <= 1:
            raise ConfigError(f"top_p must be in (0, 1], got {top_p!r}", "use 1.0 to turn top-p off")
        _int("top_k", self.top_k, 0, "use 0 to turn top-k off")
        if self.seed is not None:
            _int("seed", self.seed, 0, "pass a seed >= 0, or None for fresh randomness")
        if self.gamma is not None:
            _int("gamma", self.gamma, 1, "pass gamma=1 or more, or None for the default")
        if self.gamma_policy not in GAMMA_POLICIES:
            raise ConfigError(f"gamma_policy {self.gamma_policy!r} is unknown", f"choose one of {', '.join(GAMMA_POLICIES)}")
        if self.coupling not in COUPLINGS:
            raise ConfigError(f"coupling {self.coupling!r} is unknown", f"choose one of {', '.join(COUPLINGS)}")
        if self.drafter not in DRAFTERS:
            raise ConfigError(f"drafter {self.drafter!r} is unknown", f"choose one of {', '.join(DRAFTERS)}")
        _int("lookup_ngram", self.lookup_ngram, 1, "use lookup_ngram=3")
        _int("lookup_min_ngram", self.lookup_min_ngram, 1, "use lookup_min_ngram=2")
        if self.lookup_min_ngram > self.lookup_ngram:
            raise ConfigError(
                f"need 1 <= lookup_min_ngram <= lookup_ngram, got {self.lookup_min_ngram} and {self.lookup_ngram}",
                "use lookup_min_ngram=2, lookup_ngram=3",
            )
        if self.eos_token_ids is not None:
            object.__setattr__(self, "eos_token_ids", tuple(self.eos_token_ids))
            for token in self.eos_token_ids:
                _int("an eos_token_id", token, 0, "pass token ids of the bundle's vocabulary")
        if not isinstance(self.chat, bool):
            raise ConfigError(f"chat must be True or False, got {self.chat!r}", "pass chat=True to use the chat template")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def _int(name: str, value, minimum: int, hint: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"{name} must be an integer >= {minimum}, got {value!r}", hint)


def _stops(stop) -> tuple:
    """A tuple of non-empty stop strings; a lone string is one stop string (not one per character)."""
    stops = (stop,) if isinstance(stop, str) else stop
    try:
        stops = tuple(stops)
    except TypeError:
        raise ConfigError(f"stop must be a string or a list of strings, got {stop!r}", "pass stop=['###']") from None
    for item in stops:
        if not isinstance(item, str) or not item:
            raise ConfigError(f"stop strings must be non-empty strings, got {item!r}", "drop empty stop strings")
        try:
            item.encode("utf-8")
        except UnicodeEncodeError:
            raise ConfigError(f"stop string {item!r} is not valid Unicode text", "pass valid UTF-8 text") from None
    return stops
