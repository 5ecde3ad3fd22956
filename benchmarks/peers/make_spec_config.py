"""Peer set-up (stdlib only): an onnxruntime-genai composite configuration for draft-model speculative decoding.
The folder links the target's and the draft's model-builder folders as target/ and draft/ (the runtime refuses
paths with ".."), points model.decoder and model.draft at them, copies the target's tokenizer files, and sets
speculative.max_draft_tokens."""
from __future__ import annotations

import argparse
import json
import os
import shutil
from pathlib import Path

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json")


def link(source: Path, name: Path) -> None:
    if name.is_symlink() or name.exists():
        name.unlink()
    name.symlink_to(os.path.relpath(source, name.parent), target_is_directory=True)


def composite_config(target: Path, draft: Path, out: Path, max_draft_tokens: int) -> dict:
    config = json.loads((target / "genai_config.json").read_text())
    draft_decoder = json.loads((draft / "genai_config.json").read_text())["model"]["decoder"]
    link(target, out / "target")
    link(draft, out / "draft")
    config["model"]["decoder"]["filename"] = "target/" + config["model"]["decoder"]["filename"]
    draft_decoder["filename"] = "draft/" + draft_decoder["filename"]
    config["model"]["draft"] = draft_decoder
    config["speculative"] = {"max_draft_tokens": max_draft_tokens}
    return config


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--target", required=True, type=Path)
    parser.add_argument("--draft", required=True, type=Path)
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--max-draft-tokens", type=int, default=4)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    config = composite_config(args.target.resolve(), args.draft.resolve(), args.out.resolve(), args.max_draft_tokens)
    (args.out / "genai_config.json").write_text(json.dumps(config, indent=4))
    for name in TOKENIZER_FILES:
        if (args.target / name).is_file():
            shutil.copy(args.target / name, args.out / name)
    print(f"wrote {args.out / 'genai_config.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
