"""Run the speculative loop under a γ policy (specdec.runtime.adaptive_gamma) and compare policies.

The loop asks its policy for γ before each round and tells it (proposed, accepted) after each row's acceptance.
Batch 1 here.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from specdec.runtime.adaptive_gamma import FixedGamma, HeuristicGamma, adaptive_from_record
from specdec.runtime.config import GenerationConfig
from specdec.runtime.drafters import ModelDrafter
from specdec.runtime.loop import SpeculativeLoop
from specdec.runtime.state import Row


def run_policy(gen, prompt: str, config: GenerationConfig, policy) -> tuple[list, object, float]:
    """One greedy/sampled request with drafter='model' under `policy` -> (token ids, stats, seconds)."""
    ids = gen.codec.chat(prompt) if config.chat else gen.codec.encode(prompt)
    row = Row(tokens=list(ids), prompt_len=len(ids), rng=np.random.default_rng(config.seed))
    chunk = gen.manifest.defaults.max_prefill_chunk
    gen.target.reset(1)
    gen.draft.reset(1)
    loop = SpeculativeLoop(gen.target, ModelDrafter(gen.draft, config, chunk), config, policy, chunk,
                           gen.manifest.tokenizer.eos_token_ids)
    started = time.perf_counter()
    loop.prefill([row])
    while not row.finish:
        loop.step([row])
    return row.tokens[row.prompt_len :], loop.stats, time.perf_counter() - started


@dataclass(frozen=True)
class PolicyResult:
    name: str
    tokens_per_s: float
    acceptance_rate: float
    mean_acceptance_length: float
    matches_plain: bool


def policy_factories(gamma: int, gamma_max: int, calibration: dict) -> dict:
    """name -> zero-argument factory, for fixed γ = 1..γ_max, the calibrated γ, ours and the HF heuristic."""
    policies = {f"fixed γ={g}": (lambda g=g: FixedGamma(g)) for g in range(1, gamma_max + 1)}
    policies[f"calibrated γ={gamma}"] = lambda: FixedGamma(gamma)
    policies["adaptive (ours)"] = lambda: adaptive_from_record(calibration, gamma_max, 0.7, 0.3)
    policies["heuristic (HF)"] = lambda: HeuristicGamma(gamma, gamma_max)
    return policies


def compare_policies(bundle: Path, prompts, max_new_tokens: int = 64, progress: bool = False) -> list:
    """Tokens/s of every policy of `policy_factories` on the same prompts (greedy, chat)."""
    import specdec
    from tqdm.auto import tqdm

    config = GenerationConfig(max_new_tokens=max_new_tokens, drafter="model", chat=True)
    results = []
    with specdec.load(bundle, verify=False) as gen:
        plain = [gen.generate(p, GenerationConfig(max_new_tokens=max_new_tokens, drafter="none", chat=True)).token_ids
                 for p in prompts]
        record = (gen.manifest.draft.calibration or {}).get("gamma", {})
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
