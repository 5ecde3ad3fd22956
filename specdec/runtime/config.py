"""GenerationConfig: the options of one request, checked once."""
from __future__ import annotations

from dataclasses import dataclass

from specdec.errors import ConfigError

DRAFTERS = ("auto", "model", "prompt_lookup", "none")
GAMMA_POLICIES = ("fixed", "adaptive", "heuristic")


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
    stop: tuple = ()  # stop strings
    eos_token_ids: tuple | None = None  # None: the bundle's EOS ids
    chat: bool = False  # wrap a text prompt in the bundle's chat template
    lookup_ngram: int = 3  # longest n-gram prompt lookup tries to match
    lookup_min_ngram: int = 2  # shortest; a 1-token match proposes mostly wrong drafts

    def __post_init__(self):
        object.__setattr__(self, "stop", tuple(self.stop))
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise ConfigError(f"max_new_tokens must be >= 1, got {self.max_new_tokens!r}", "pass max_new_tokens=1 or more")
        if self.temperature < 0:
            raise ConfigError(f"temperature must be >= 0, got {self.temperature}", "use 0 for greedy decoding")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"top_p must be in (0, 1], got {self.top_p}", "use 1.0 to turn top-p off")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ConfigError(f"top_k must be >= 0, got {self.top_k!r}", "use 0 to turn top-k off")
        if self.gamma is not None and (not isinstance(self.gamma, int) or self.gamma < 1):
            raise ConfigError(f"gamma must be >= 1, got {self.gamma!r}", "pass gamma=1 or more, or None for the default")
        if self.gamma_policy not in GAMMA_POLICIES:
            raise ConfigError(f"gamma_policy {self.gamma_policy!r} is unknown", f"choose one of {', '.join(GAMMA_POLICIES)}")
        if self.drafter not in DRAFTERS:
            raise ConfigError(f"drafter {self.drafter!r} is unknown", f"choose one of {', '.join(DRAFTERS)}")
        if not 1 <= self.lookup_min_ngram <= self.lookup_ngram:
            raise ConfigError(
                f"need 1 <= lookup_min_ngram <= lookup_ngram, got {self.lookup_min_ngram} and {self.lookup_ngram}",
                "use lookup_min_ngram=2, lookup_ngram=3",
            )
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ConfigError(f"stop strings must be non-empty strings, got {self.stop!r}", "drop empty stop strings")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0
