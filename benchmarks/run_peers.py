"""Run the peers, each as a separate process in its own virtual environment, and merge their results.

    benchmarks/peers/setup.sh                                   # once: venvs and models under benchmarks/.peers/
    specdec bench bundles/smollm2 --out benchmarks/results ...   # our modes
    python benchmarks/run_peers.py --bundle bundles/smollm2 --merge benchmarks/results --per-class 1 ...

Each peer writes JSONL records (benchmarks/peers/peer_common.py) into --out; with --merge the finished bench
folder's tables, markdown and plots are rewritten with the peers beside specdec (needs specdec[bench]). A peer whose
venv is missing or whose process fails is recorded as such in the table, never left out silently.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
PEERS = {  # name -> (venv folder under benchmarks/.peers, script, system name in the table)
    "hf": ("hf", "hf_peer.py", "transformers"),
    "ortgenai": ("ortgenai", "ortgenai_peer.py", "onnxruntime-genai"),
}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bundle", required=True)
    parser.add_argument("--prompts", default=str(HERE / "prompts"))
    parser.add_argument("--peers-dir", default=str(HERE / ".peers"), help="venvs and models from setup.sh")
    parser.add_argument("--out", default=None, help="folder for the peers' JSONL (default: MERGE/peers)")
    parser.add_argument("--merge", default=None, help="a finished `specdec bench` --out folder to merge into")
    parser.add_argument("--only", default="hf,ortgenai", help="comma-separated peers (default hf,ortgenai)")
    parser.add_argument("--per-class", type=int, default=1)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--gamma", type=int, default=4)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--timeout", type=int, default=1800, help="seconds per peer")
    return parser.parse_args()


def failure(system: str, note: str) -> str:
    return json.dumps(dict(system=system, mode="(all)", status="failed", note=note[-400:])) + "\n"


def run_peer(name: str, args: argparse.Namespace, out: Path) -> Path:
    venv, script, system = PEERS[name]
    python = Path(args.peers_dir) / venv / "bin" / "python"
    result = out / f"{name}.jsonl"
    if not python.is_file():
        result.write_text(failure(system, f"no venv at {python.parent.parent}: run benchmarks/peers/setup.sh"))
        return result
    command = [str(python), str(HERE / "peers" / script), "--bundle", args.bundle,
               "--models", str(Path(args.peers_dir) / "models"), "--prompts", args.prompts,
               "--per-class", str(args.per_class), "--new-tokens", str(args.new_tokens),
               "--repeats", str(args.repeats), "--gamma", str(args.gamma), "--layers", str(args.layers),
               "--out", str(result)]
    print(f"[run_peers] {name}: {' '.join(command)}", file=sys.stderr)
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=args.timeout)
    except subprocess.TimeoutExpired:
        result.write_text(failure(system, f"timed out after {args.timeout} s"))
        return result
    if done.returncode != 0:
        result.write_text(failure(system, f"exit {done.returncode}: {done.stderr.strip()}"))
    return result


def main() -> int:
    args = parse_args()
    out = Path(args.out or (Path(args.merge) / "peers" if args.merge else "peer-results"))
    out.mkdir(parents=True, exist_ok=True)
    for name in [n.strip() for n in args.only.split(",") if n.strip()]:
        if name not in PEERS:
            raise SystemExit(f"unknown peer {name!r}; choose from {', '.join(PEERS)}")
        print(f"[run_peers] wrote {run_peer(name, args, out)}", file=sys.stderr)
    if args.merge:
        from specdec.bench.report import merge_peer_results

        paths = merge_peer_results(args.merge, out)
        print(paths["markdown"].read_text(encoding="utf-8"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
