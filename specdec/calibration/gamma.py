"""γ calibration: per-position acceptance on calibration prompts and the draft/target step-time ratio c on this
machine -> the γ of docs/design.md's expected speed, written into the manifest's defaults.gamma."""
from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from specdec.calibration.bundle_io import write_manifest
from specdec.calibration.quality import DEFAULT_PROMPTS, interleaved_ms
from specdec.errors import ConfigError
from specdec.manifest import GammaRecord, Role, read_manifest
from specdec.runtime.adaptive_gamma import best_gamma, conditional_from_cumulative, speedup_table

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class GammaConfig:
    prompts: tuple = DEFAULT_PROMPTS
    max_new_tokens: int = 128  # 4 prompts x 128 tokens: about 60 rounds at γ_max 8
    gamma_max: int | None = None  # None: the bundle's gamma_max
    with_verify_cost: bool = True  # the measured r(γ); False: the paper's model, a verify pass costs one target step
    chat: bool = True  # wrap prompts in the chat template where the bundle's tokenizer has one
    progress: bool = False

    def __post_init__(self):
        object.__setattr__(self, "prompts", tuple(self.prompts))
        if not self.prompts or any(not isinstance(p, str) or not p for p in self.prompts):
            raise ConfigError("γ calibration needs at least one non-empty prompt", "pass --prompt TEXT (repeatable)")
        if self.max_new_tokens < 8:
            raise ConfigError(f"max_new_tokens {self.max_new_tokens} is too few to measure acceptance", "use 64")


@dataclass(frozen=True)
class GammaCalibration:
    gamma: int
    cumulative: list  # A_j: fraction of rounds whose first j drafts were all accepted, j = 1..γ_max
    alphas: list  # conditional α_j
    cost_ratio: float  # c: draft step / target step (T = 1)
    verify_cost: list  # r(γ): target pass of γ+1 tokens / target pass of 1, γ = 1..γ_max
    speedups: list  # expected speedup per γ under the chosen model
    rounds: int
    verify_cost_used: bool = True  # speedups and γ count r(γ) (else the paper's r = 1)

    def record(self) -> GammaRecord:
        return GammaRecord(**dataclasses.asdict(self), measured_at=time.strftime("%Y-%m-%dT%H:%M:%S"))


def measure_acceptance(gen, config: GammaConfig, gamma_max: int) -> tuple[np.ndarray, int]:
    """Greedy rounds of γ_max drafts on the prompts -> (cumulative acceptance [γ_max], rounds)."""
    from tqdm.auto import tqdm

    from specdec.runtime import GenerationConfig

    proposed = np.zeros(gamma_max)
    accepted = np.zeros(gamma_max)
    rounds = 0
    chat = config.chat and gen.codec.has_chat_template  # raw-text prompts where the tokenizer has no chat template
    run = GenerationConfig(max_new_tokens=config.max_new_tokens, temperature=0.0, drafter="model", gamma=gamma_max,
                           chat=chat)
    for prompt in tqdm(config.prompts, disable=not config.progress, desc="acceptance", unit="prompt"):
        stats = gen.generate(prompt, run).stats
        count = len(stats.position_proposed)
        proposed[:count] += stats.position_proposed
        accepted[:count] += stats.position_accepted
        rounds += stats.verify_passes
    if not proposed.any():
        raise ConfigError("no drafts were proposed on the calibration prompts", "use longer prompts or max_new_tokens")
    cumulative = np.divide(accepted, proposed, out=np.zeros(gamma_max), where=proposed > 0)
    return np.minimum.accumulate(cumulative), rounds  # A_j never grows with j; unmeasured tail stays at 0


def measure_costs(gen, gamma_max: int, context: int = 64) -> tuple[float, np.ndarray]:
    """(c, r[γ_max]) from median forward times of both models at cache_len = context, measured in turn."""
    target, draft = gen.target.backend, gen.draft.backend
    calls = [(target, 1), (draft, 1)] + [(target, g + 1) for g in range(1, gamma_max + 1)]
    one, drafted, *passes = interleaved_ms(calls, context, repeats=20)
    cost_ratio = drafted / one
    verify = np.array(passes) / one
    target.reset(1)
    draft.reset(1)
    return cost_ratio, verify


def tune_gamma(bundle: Path, config: GammaConfig) -> GammaCalibration:
    """Measure and choose γ; does not write anything."""
    from specdec.runtime import load

    with load(bundle, verify=False) as gen:
        if gen.draft is None:
            raise ConfigError(f"bundle {str(bundle)!r} has no draft model", "γ calibration needs a model draft")
        gamma_max = config.gamma_max or gen.manifest.defaults.gamma_max
        if not 1 <= gamma_max <= gen.manifest.defaults.gamma_max:
            raise ConfigError(f"gamma_max {gamma_max} is outside 1..{gen.manifest.defaults.gamma_max}",
                              "pass a --gamma-max the bundle's verify profile allows")
        cumulative, rounds = measure_acceptance(gen, config, gamma_max)
        cost_ratio, verify = measure_costs(gen, gamma_max)
    verify_cost = verify if config.with_verify_cost else None
    speedups = speedup_table(cumulative, cost_ratio, verify_cost)
    gamma = best_gamma(cumulative, cost_ratio, verify_cost)
    log.info("γ=%d: c=%.3f, A=%s, speedups=%s", gamma, cost_ratio, np.round(cumulative, 3), np.round(speedups, 2))
    return GammaCalibration(gamma, cumulative.tolist(), conditional_from_cumulative(cumulative).tolist(),
                            float(cost_ratio), verify.tolist(), speedups.tolist(), rounds, config.with_verify_cost)


def calibrate_gamma(bundle: Path, config: GammaConfig) -> GammaCalibration:
    """tune_gamma, then write defaults.gamma (and the measurements, in the draft's calibration record)."""
    bundle = Path(bundle)
    result = tune_gamma(bundle, config)
    manifest = read_manifest(bundle)
    draft = manifest.draft
    draft = dataclasses.replace(draft, calibration=dataclasses.replace(draft.calibration, gamma=result.record()))
    write_manifest(bundle, dataclasses.replace(
        manifest, defaults=dataclasses.replace(manifest.defaults, gamma=result.gamma),
        models={**manifest.models, Role.DRAFT: draft},
    ))
    return result
