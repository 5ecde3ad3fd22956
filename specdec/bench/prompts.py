"""Prompt sets: JSONL lines {"id", "class", "prompt", "chat"}; one file per class under benchmarks/prompts/."""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

from specdec.errors import ConfigError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Prompt:
    id: str
    cls: str  # workload class: chat, story, code, rewrite, summarize
    text: str
    chat: bool  # wrap in the chat template


def prompt_from_json(line: str, where: str) -> Prompt:
    try:
        item = json.loads(line)
        prompt = Prompt(str(item["id"]), str(item["class"]), item["prompt"], bool(item.get("chat", True)))
    except (ValueError, KeyError, TypeError) as exc:
        raise ConfigError(f"{where}: not a prompt record ({exc})",
                          'each line must be a JSON object with "id", "class", "prompt" and optional "chat"') from exc
    if not isinstance(prompt.text, str) or not prompt.text:
        raise ConfigError(f"{where}: the prompt is empty or not a string", "give every record a non-empty prompt")
    return prompt


def read_jsonl(files: list, parse) -> list:
    """parse(line, "file:line") for every non-blank line of every file, in order."""
    records = []
    for file in files:
        for number, line in enumerate(Path(file).read_text(encoding="utf-8").splitlines(), 1):
            if line.strip():
                records.append(parse(line, f"{file}:{number}"))
    return records


def read_prompts(path: str | Path) -> list:
    """All prompts of a .jsonl file or of every *.jsonl file in a folder (sorted by file name)."""
    root = Path(path)
    files = sorted(root.glob("*.jsonl")) if root.is_dir() else [root]
    if not files or not files[0].is_file():
        raise ConfigError(f"no prompt files at {root}", "pass --prompts DIR holding *.jsonl (e.g. benchmarks/prompts)")
    prompts = read_jsonl(files, prompt_from_json)
    ids = [p.id for p in prompts]
    if len(set(ids)) != len(ids):
        dup = next(i for i in ids if ids.count(i) > 1)
        raise ConfigError(f"prompt id {dup!r} occurs twice", "give every prompt a unique id")
    return prompts


def select_prompts(prompts: list, lengths: dict, per_class: int, room: int) -> list:
    """Prompts whose token count fits `room`; per class the first `per_class` (0: all), or with per_class 1 the
    shortest (a smoke run). lengths: prompt id -> token count."""
    fitting = [p for p in prompts if lengths[p.id] <= room]
    if len(fitting) < len(prompts):
        log.warning("%d prompts skipped: longer than the %d tokens the bundle leaves", len(prompts) - len(fitting), room)
    if not fitting:
        raise ConfigError(f"no prompt fits in {room} tokens", "lower --new-tokens or use a bundle with a larger S")
    chosen = []
    for cls in dict.fromkeys(p.cls for p in fitting):
        members = [p for p in fitting if p.cls == cls]
        if per_class == 1:
            members = [min(members, key=lambda p: lengths[p.id])]
        chosen += members[:per_class] if per_class else members
    return chosen
