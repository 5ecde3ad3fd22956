"""Peer set-up (stdlib only): onnxruntime-genai at the settings its documentation tells CPU users to tune.

Writes model.decoder.session_options.intra_op_num_threads = the number of cores (onnxruntime's default pool size
is the physical core count, which on a small VM can differ from the cores this process may use) into each
genai_config.json given, and inter_op_num_threads = 1 (sequential execution). Spinning stays at onnxruntime's
default (on), which suits a single session decoding token after token. Idempotent.

    python tune_config.py MODEL_DIR [MODEL_DIR ...]
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

SETTINGS = {"intra_op_num_threads": len(os.sched_getaffinity(0)), "inter_op_num_threads": 1}


def tune(model_dir: Path) -> dict:
    path = model_dir / "genai_config.json"
    config = json.loads(path.read_text())
    for section in ("decoder", "draft"):
        if section in config["model"]:
            config["model"][section].setdefault("session_options", {}).update(SETTINGS)
    path.write_text(json.dumps(config, indent=4))
    return config["model"]["decoder"]["session_options"]


if __name__ == "__main__":
    for folder in sys.argv[1:]:
        print(f"[tune_config] {folder}: {tune(Path(folder))}", file=sys.stderr)
