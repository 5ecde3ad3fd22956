"""BenchConfig: the options of one benchmark run, checked once; Mode: one way of decoding."""
from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path

from specdec.errors import ConfigError
from specdec.runtime.adaptive_gamma import GammaPolicyName
from specdec.runtime.config import DRAFTER_KINDS, DRAFTERS, NAMED_BACKENDS, BackendName, DrafterName

BASELINE = "target-only"
SYSTEM = "specdec"  # the `system` of this package's records (a peer writes its own name)
SWEPT_POLICIES = (GammaPolicyName.ADAPTIVE, GammaPolicyName.HEURISTIC)  # besides fixed
BENCH_DRAFTERS = (DrafterName.MODEL, DrafterName.PROMPT_LOOKUP, DrafterName.AUTO)  # besides target-only


class Status(StrEnum):
    """A record's `status`."""

    OK = "ok"  # measured
    UNSUPPORTED = "unsupported"  # a peer cannot run the mode (the reason in `note`)
    FAILED = "failed"  # it ran and failed (the reason in `note`)


@dataclass(frozen=True)
class Mode:
    """One way of decoding: `drafter` as in GenerationConfig, `gamma` None for the bundle's default."""

    name: str
    drafter: str
    gamma: int | None = None
    gamma_policy: GammaPolicyName = GammaPolicyName.FIXED  # as GenerationConfig.gamma_policy


@dataclass(frozen=True)
class BenchConfig:
    bundle: str
    out: str
    prompts: str = "benchmarks/prompts"  # a folder of *.jsonl prompt sets, or one .jsonl file
    per_class: int = 0  # prompts taken from each class (0: all)
    max_new_tokens: int = 96
    repeats: int = 2
    warmup: int = 1  # warm-up requests per mode, not recorded
    seed: int = 0
    drafters: tuple = BENCH_DRAFTERS
    gammas: tuple = (1, 2, 4, 6, 8)  # γ sweep of the model and auto drafters
    policies: tuple = ()  # γ policies of the model drafter besides fixed: "adaptive", "heuristic"
    temperature: float = 0.0
    threads: int | None = None
    backend: BackendName = BackendName.ONNXRUNTIME  # or NATIVE / CUDA (the target on specdec's own CPU / GPU kernels)
    activations: str | None = None  # the native target's, fp32, int8 or bf16 (None: the bundle's default; load())
    verify: bool = True  # check the bundle's file hashes
    peers: str | None = None  # a folder of peer results (*.jsonl) to merge into the table
    plots: bool = True
    truncate: bool = False  # cut a prompt longer than the bundle leaves to its last tokens (else skip it)
    progress: bool = True

    def __post_init__(self):
        object.__setattr__(self, "drafters", tuple(self.drafters))
        object.__setattr__(self, "gammas", tuple(sorted(set(self.gammas))))
        object.__setattr__(self, "policies", tuple(self.policies))
        bad_policies = [p for p in self.policies if p not in SWEPT_POLICIES]
        if bad_policies:
            raise ConfigError(f"unknown γ policies {bad_policies}", "use --gamma-policies adaptive,heuristic")
        if not Path(self.bundle).is_dir():
            raise ConfigError(f"bundle {self.bundle!r} is not a directory", "export one with specdec-export --out DIR")
        for name, value, low in (("max_new_tokens", self.max_new_tokens, 1), ("repeats", self.repeats, 1),
                                 ("warmup", self.warmup, 0), ("per_class", self.per_class, 0)):
            if not isinstance(value, int) or value < low:
                raise ConfigError(f"{name} must be an integer >= {low}, got {value!r}", f"pass {name}={low} or more")
        if self.backend not in NAMED_BACKENDS:
            raise ConfigError(f"backend {self.backend!r} is not a backend a benchmark can name",
                              f"use one of {', '.join(NAMED_BACKENDS)}")
        if self.activations is not None:
            from specdec.runtime.native_backend import checked_activations

            object.__setattr__(self, "activations", checked_activations(self.activations))
        bad = [d for d in self.drafters if d not in DRAFTERS or not DRAFTER_KINDS[d].drafts]
        if bad:
            raise ConfigError(f"drafter {bad[0]!r} is unknown", "choose from model, prompt_lookup, auto, head")
        if any(not isinstance(g, int) or g < 1 for g in self.gammas):
            raise ConfigError(f"every gamma must be an integer >= 1, got {self.gammas!r}", "e.g. --gammas 1,2,4,8")
        if self.temperature < 0:
            raise ConfigError(f"temperature must be >= 0, got {self.temperature}", "use 0 for greedy decoding")

    @classmethod
    def quick(cls, bundle: str, out: str, **options) -> "BenchConfig":
        """A small smoke run: the shortest prompt of each class (cut to fit), few tokens, one repeat, γ ∈ {1, 2}."""
        base = dict(per_class=1, max_new_tokens=12, repeats=1, warmup=1, gammas=(1, 2), truncate=True)
        base.update(options)
        return cls(bundle=bundle, out=out, **base)


def plan_modes(config: BenchConfig, has_draft: bool, gamma_default: int, gamma_max: int,
               has_head: bool = False) -> list:
    """Target-only, each drafter at the bundle's γ (head only where the bundle has a draft head), and the γ sweep
    (γ ≤ γ_max) of the drafters that run the draft model: model and auto (the default drafter, whose best γ need not
    be the model's)."""
    modes = [Mode(BASELINE, DrafterName.NONE)]
    for drafter in config.drafters:
        kind = DRAFTER_KINDS[drafter]
        if kind.needs_model and not has_draft or kind.needs_head and not has_head:
            continue
        modes.append(Mode(f"{drafter} γ={gamma_default}", drafter, gamma_default))
    swept = [d for d in (DrafterName.MODEL, DrafterName.AUTO) if d in config.drafters] if has_draft else []
    for drafter in swept:
        for gamma in config.gammas:
            if gamma != gamma_default and gamma <= gamma_max:
                modes.append(Mode(f"{drafter} γ={gamma}", drafter, gamma))
    if DrafterName.MODEL in swept:
        for policy in config.policies:
            modes.append(Mode(f"model {policy} γ from {gamma_default}", DrafterName.MODEL, gamma_default, policy))
    return modes
