"""The benchmark loop: warm-up, interleaved repeats with the mode order rotated per repeat, one record per request."""
from __future__ import annotations

import logging
import time
from pathlib import Path

from specdec.bench.config import SYSTEM, BenchConfig, Mode, Status, plan_modes
from specdec.bench.prompts import read_prompts, select_prompts
from specdec.runtime.config import DRAFTER_KINDS

log = logging.getLogger(__name__)


def record_from_result(result, elapsed: float, mode: Mode, gamma: int, prompt, repeat: int, seed: int) -> dict:
    """One request's row of the table (the columns of specdec.bench.table.COLUMNS)."""
    stats = result.stats
    new = len(result.token_ids)
    ttft = stats.first_token_s
    proposed, passes = stats.proposed, stats.verify_passes
    return dict(
        system=SYSTEM, mode=mode.name, drafter=mode.drafter, gamma=gamma if DRAFTER_KINDS[mode.drafter].drafts else 0,
        note="", status=Status.OK, prompt_id=prompt.id, cls=prompt.cls, repeat=repeat, seed=seed,
        prompt_tokens=len(result.prompt_ids), new_tokens=new, finish_reason=result.finish_reason,
        ttft_s=ttft, tpot_s=(elapsed - ttft) / (new - 1) if new > 1 else 0.0, e2e_s=elapsed,
        tokens_per_s=new / elapsed if elapsed else 0.0, prefill_s=stats.prefill_s, draft_s=stats.draft_s,
        verify_s=stats.verify_s, host_s=stats.host_s, proposed=proposed,
        accepted=stats.accepted, verify_passes=passes,
        drafted_rounds=stats.position_proposed[0] if stats.position_proposed else 0,
        acceptance_rate=stats.acceptance_rate if proposed else None,
        mean_acceptance_length=stats.mean_acceptance_length if passes else None,
        per_position=[float(x) for x in stats.per_position_acceptance], token_ids=[int(t) for t in result.token_ids],
    )


def rotated(modes: list, repeat: int) -> list:
    """The mode order of one repeat: shifted by one per repeat, so no mode always runs first or last."""
    shift = repeat % len(modes)
    return modes[shift:] + modes[:shift]


def run_one(generator, config: BenchConfig, mode: Mode, prompt, ids: list, repeat: int, seed: int,
            new_tokens: int) -> dict:
    from specdec.runtime.config import GenerationConfig

    gamma = mode.gamma or generator.manifest.defaults.gamma
    request = GenerationConfig(max_new_tokens=new_tokens, temperature=config.temperature, seed=seed,
                               gamma=gamma if DRAFTER_KINDS[mode.drafter].drafts else None, drafter=mode.drafter,
                               gamma_policy=mode.gamma_policy)
    started = time.perf_counter()
    result = generator.generate(ids, request)
    elapsed = time.perf_counter() - started
    return record_from_result(result, elapsed, mode, gamma, prompt, repeat, seed)


def run_requests(generator, config: BenchConfig, modes: list, prompts: list, ids: dict) -> list:
    """Warm-up requests (not recorded), then repeats × prompts × modes, interleaved per prompt."""
    from tqdm import tqdm

    first = prompts[0]
    for mode in modes:
        for _ in range(config.warmup):
            run_one(generator, config, mode, first, ids[first.id], -1, config.seed, min(8, config.max_new_tokens))
    records = []
    total = config.repeats * len(prompts) * len(modes)
    with tqdm(total=total, desc="bench", unit="req", disable=not config.progress) as bar:
        for repeat in range(config.repeats):
            order = rotated(modes, repeat)
            for index, prompt in enumerate(prompts):
                seed = config.seed + 1000 * repeat + index
                for mode in order:
                    records.append(run_one(generator, config, mode, prompt, ids[prompt.id], repeat, seed,
                                           config.max_new_tokens))
                    bar.update(1)
    return records


def prompt_ids(generator, prompts: list, keep_last: int | None = None) -> dict:
    """prompt id -> token ids (the chat template applied where the record asks for it and the bundle has one: a
    base model's bundle takes every prompt as raw text), cut to the last `keep_last` tokens when given."""
    codec = generator.codec
    chat = codec.has_chat_template
    if not chat and any(p.chat for p in prompts):
        log.warning("the bundle has no chat template: chat prompts are benchmarked as raw text")
    ids = {p.id: chat_ids(generator, p.text) if p.chat and chat else codec.encode(p.text) for p in prompts}
    return ids if keep_last is None else {k: v[-keep_last:] for k, v in ids.items()}


def chat_ids(generator, text: str) -> list:
    """Token ids of `text` as one user turn through the bundle's chat template, rendered by the generator's prompt
    worker on its budget (not cut to S: prompt_ids keeps the last tokens where asked)."""
    return generator.prompt_worker.chat_ids([{"role": "user", "content": text}])


def run_bench(config: BenchConfig, command: str = "") -> dict:
    """Run the benchmark and write its outputs into config.out; returns {output kind: path}.
    `command` is recorded in the markdown summary (how to reproduce the run)."""
    from specdec.runtime import load
    from specdec.bench.report import write_outputs

    with load(config.bundle, backend=config.backend, verify=config.verify, threads=config.threads,
              activations=config.activations) as generator:
        manifest = generator.manifest
        every = read_prompts(config.prompts)
        room = manifest.target.max_seq_len - config.max_new_tokens - 1
        ids = prompt_ids(generator, every, room if config.truncate else None)
        prompts = select_prompts(every, {k: len(v) for k, v in ids.items()}, config.per_class, room)
        modes = plan_modes(config, generator.draft is not None, manifest.defaults.gamma, manifest.defaults.gamma_max,
                           generator.head is not None)
        log.info("%d prompts x %d modes x %d repeats", len(prompts), len(modes), config.repeats)
        records = run_requests(generator, config, modes, prompts, ids)
        pair = describe_pair(manifest)
        prompt_format = describe_prompt_format(generator.codec.has_chat_template)
    peers = read_peer_records(config.peers) if config.peers else []
    info = dict(describe_run(config, prompts, modes), command=command, models=pair, prompt_format=prompt_format)
    return write_outputs(records + peers, config.out, info, config.plots)


def read_peer_records(folder: str) -> list:
    from specdec.bench.peers import read_peer_results

    return read_peer_results(Path(folder))


def describe_prompt_format(has_chat_template: bool) -> str:
    if has_chat_template:
        return "the chat template where a prompt asks for it"
    return "raw text (the bundle has no chat template)"


def describe_pair(manifest) -> str:
    def entry(model) -> str:
        return f"{model.precision}, {model.dims.num_layers} layers, S={model.max_seq_len}"

    draft = entry(manifest.draft) if manifest.draft is not None else "none"
    return f"target {entry(manifest.target)}; draft {draft}; γ={manifest.defaults.gamma} (γ_max {manifest.defaults.gamma_max})"


def describe_run(config: BenchConfig, prompts: list, modes: list) -> dict:
    classes = sorted({p.cls for p in prompts})
    return dict(bundle=config.bundle, prompts=len(prompts), classes=classes, modes=[m.name for m in modes],
                repeats=config.repeats, max_new_tokens=config.max_new_tokens, temperature=config.temperature,
                warmup=config.warmup, seed=config.seed)
