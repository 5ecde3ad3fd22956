"""The options of `specdec calibrate head BUNDLE` without `--from`: training a head from the target."""
from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from enum import StrEnum
from pathlib import Path

from specdec.errors import ConfigError


class Precision(StrEnum):
    """The training's products (--precision)."""

    AUTO = "auto"  # BF16 where the CPU has one of BF16_CPU, else FP32
    BF16 = "bf16"  # torch autocast; weights, optimizer and the loss's softmax stay fp32
    FP32 = "fp32"


PRECISIONS = tuple(str(p) for p in Precision)
BF16_CPU = ("amx_bf16", "avx512_bf16")  # /proc/cpuinfo flags of a CPU whose bf16 products (oneDNN) outrun fp32
HINT = "see `specdec calibrate head --help` (docs/heads.md, Training a head)"
COUNT = {"positive": int}  # a field that must be a positive integer
RESUMED = {"positive": int, "fingerprint": True}  # ... which a resumed run must share with the run it continues


def _positive(name: str, value, kind=int, optional: bool = False) -> None:
    if optional and value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float) if kind is float else int) or \
            not math.isfinite(value) or value <= 0:
        raise ConfigError(f"--{name.replace('_', '-')} must be a positive {'number' if kind is float else 'integer'}, "
                          f"not {value!r}", HINT)


@dataclass(frozen=True)
class HeadTrainConfig:
    out: str | None = None  # a copy of the bundle with the head (None: the head goes into the bundle itself)
    work: str | None = None  # data and checkpoints (None: beside the output, "<name>.head-train")
    resume: bool = False  # continue the run whose data and checkpoint are in `work`
    overwrite: bool = False  # replace an existing --out and start `work` again
    minutes: float | None = None  # the whole run's wall-clock budget
    data_tokens: int = field(default=300_000, metadata=COUNT)  # answer tokens to generate (the data's size)
    data_share: float = 0.45  # with --minutes: the part of it the data may take
    max_new_tokens: int = field(default=192, metadata=RESUMED)  # per answer
    rows: int = field(default=16, metadata=COUNT)  # prompts answered at once
    draft_vocab: int = field(default=4096, metadata=RESUMED)  # V'
    steps: int | None = None  # training steps (None: `epochs` passes, or what --minutes leaves)
    epochs: float = 2.0
    batch_tokens: int = field(default=2048, metadata=RESUMED)
    lr: float = field(default=6e-4, metadata={"fingerprint": True})
    chain_steps: int = field(default=3, metadata=RESUMED)
    seed: int = field(default=0, metadata={"fingerprint": True})
    activations: str | None = field(default=None, metadata={"fingerprint": True})  # the data's (None: the bundle's)
    threads: int | None = None
    asked_share: float = field(default=0.0, metadata={"fingerprint": True})  # of the prompts, the target writes
    precision: Precision = Precision.AUTO

    def __post_init__(self):
        for each in fields(self):
            if each.metadata.get("positive") is int:
                _positive(each.name, getattr(self, each.name))
        _positive("steps", self.steps, optional=True)
        _positive("threads", self.threads, optional=True)
        _positive("minutes", self.minutes, float, optional=True)
        _positive("epochs", self.epochs, float)
        _positive("lr", self.lr, float)
        if not 0 < self.data_share < 1:
            raise ConfigError(f"the data's share of --minutes must be in (0, 1), not {self.data_share!r}", HINT)
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            raise ConfigError(f"--seed must be an integer >= 0, not {self.seed!r}", HINT)
        if self.activations is not None:
            from specdec.runtime.native_backend import checked_activations

            object.__setattr__(self, "activations", str(checked_activations(self.activations)))
        if isinstance(self.asked_share, bool) or not isinstance(self.asked_share, (int, float)) or \
                not 0 <= self.asked_share <= 1:
            raise ConfigError(f"--asked-share must be a number from 0 to 1, not {self.asked_share!r}", HINT)
        try:
            object.__setattr__(self, "precision", Precision(self.precision))
        except ValueError:
            raise ConfigError(f"--precision must be one of {', '.join(PRECISIONS)}, not {self.precision!r}",
                              HINT) from None
        if self.resume and self.overwrite:
            raise ConfigError("--resume continues a run and --overwrite starts it again: pass one of them",
                              "--resume to continue the run in the work folder, --overwrite to start afresh")

    def bf16(self, cpuinfo: Path = Path("/proc/cpuinfo")) -> bool:
        """Whether training runs its products in bf16: asked, or auto on a CPU with native bf16 products."""
        from specdec.native.build import missing_cpu_flags

        if self.precision is not Precision.AUTO:
            return self.precision is Precision.BF16
        return len(missing_cpu_flags(cpuinfo, BF16_CPU)) < len(BF16_CPU)  # one of them at least

    def fingerprint(self) -> dict:
        """What a resumed run must share with the run it continues (its data and the head's shape)."""
        return {each.name: getattr(self, each.name) for each in fields(self) if each.metadata.get("fingerprint")}
