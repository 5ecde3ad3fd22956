"""Compare γ policies (specdec.runtime.adaptive_gamma) on one bundle: the same prompts under each, through the
generator's public `run` (the loop asks its policy for γ before each round and shows it each round's record)."""
from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from specdec.runtime.adaptive_gamma import FixedGamma, HeuristicGamma, adaptive_from_record
from specdec.runtime.config import GenerationConfig


def run_policy(gen, prompt: str, config: GenerationConfig, policy) -> tuple[list, object, float]:
    """One request with `config` (drafter='model') under `policy` -> (token ids, stats, seconds)."""
    started = time.perf_counter()
    result = gen.run([prompt], config, policy)[0]
    return result.token_ids, result.stats, time.perf_counter() - started


@dataclass(frozen=True)
class PolicyResult:
    name: str
    tokens_per_s: float
    acceptance_rate: float
    mean_acceptance_length: float
    matches_plain: bool


def policy_factories(gamma: int, gamma_max: int, calibration) -> dict:
    """name -> zero-argument factory, for fixed γ = 1..γ_max, the calibrated γ, ours and the HF heuristic."""
    policies = {f"fixed γ={g}": (lambda g=g: FixedGamma(g)) for g in range(1, gamma_max + 1)}
    policies[f"calibrated γ={gamma}"] = lambda: FixedGamma(gamma)
    policies["adaptive (ours)"] = lambda: adaptive_from_record(calibration, gamma_max, 0.7, 0.3)
    policies["heuristic (HF)"] = lambda: HeuristicGamma(gamma, gamma_max)
    return policies


def compare_policies(bundle: Path, prompts, max_new_tokens: int = 64, progress: bool = False) -> list:
    """Tokens/s of every policy of `policy_factories` on the same prompts (greedy; chat where the tokenizer has a
    template)."""
    from tqdm.auto import tqdm

    from specdec.runtime import load

    results = []
    with load(bundle, verify=False) as gen:
        chat = gen.codec.has_chat_template
        config = GenerationConfig(max_new_tokens=max_new_tokens, temperature=0.0, drafter="model", chat=chat)
        plain = [gen.generate(p, GenerationConfig(max_new_tokens=max_new_tokens, temperature=0.0, drafter="none",
                                               chat=chat)).token_ids
                 for p in prompts]
        record = gen.manifest.draft.calibration.gamma
        defaults = gen.manifest.defaults
        factories = policy_factories(defaults.gamma, defaults.gamma_max, record)
        run_policy(gen, prompts[0], config, FixedGamma(defaults.gamma))  # warm-up
        for name, factory in tqdm(factories.items(), disable=not progress, desc="policies", unit="policy"):
            emitted = seconds = proposed = accepted = passes = 0
            same = True
            for prompt, expected in zip(prompts, plain):
                tokens, stats, elapsed = run_policy(gen, prompt, config, factory())
                same &= tokens == expected
                emitted, seconds = emitted + len(tokens), seconds + elapsed
                proposed, accepted, passes = proposed + stats.proposed, accepted + stats.accepted, passes + stats.verify_passes
            results.append(PolicyResult(name, emitted / seconds, accepted / max(proposed, 1),
                                        (accepted + passes) / max(passes, 1), same))
    return results
