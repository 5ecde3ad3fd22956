"""Bounded load test of `specdec serve` on 127.0.0.1: plain decoding, fixed γ and load-adaptive speculation.

One server process per mode (`specdec serve --speculation off|fixed|adaptive`), all started before the run and
idle while another is measured. For each concurrency C, every mode in turn (the order rotates with C) serves
`--requests` streamed greedy chat requests from C closed-loop clients (each sends its next request when the
previous one ends); the prompts are benchmarks/prompts/*.jsonl in order, so every mode sees the same requests.

Per (mode, C): p50/p90 TTFT (request sent -> first content), p50/p90 TPOT ((last content - first content) /
(tokens - 1)), aggregate tokens/s (completion tokens / wall time of the phase), errors, the rounds' γ as the
server counted them, and the server's RSS. Greedy outputs are compared across modes and concurrency levels.

    specdec-export --out bundles/smollm2-b8 --max-batch 8
    specdec calibrate quantize bundles/smollm2-b8 --method int4-q41 --head-tokens 24576 --out bundles/smollm2-b8-q41
    python benchmarks/serve_load.py --bundle bundles/smollm2-b8-q41 --requests 60 --repeats 3
    python benchmarks/serve_load.py --bundle B --llama-modes plain,ngram     # with llama.cpp's llama-server beside

llama.cpp takes part as a peer server (benchmarks/peers/llamacpp_peer.py, built by peers/setup_llamacpp.sh): one
llama-server per --llama-modes value on the default model's Q4_1 GGUF, threads = cores, one slot per client of the
highest concurrency (`-np`), continuous batching; the same streamed chat requests through its OpenAI-compatible
endpoint (its GGUF's chat template). --prefix-reuse on (the default of both servers) lets a request skip the prefill of
the prefix its slot holds from the previous one (specdec serve where its backend's K/V are exact by position, llama.cpp's
`cache_prompt`); off feeds every prompt whole on both.

Results: summary.md, summary.csv (the plot and the docs read it), requests.csv, throughput.png and record.json, under
benchmarks/results/serve-load/<date>-<commit>/ or --out. Not a test: it asserts nothing about timings.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import re
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import psutil

from harness import opening, record, tables, timer

MODES = {"plain": "off", "fixed": "fixed", "adaptive": "adaptive"}
LLAMA_MODES = ("plain", "ngram", "draft")  # llama.cpp's, named "llama.cpp <mode>" in the tables
ORDER = list(MODES) + [f"llama.cpp {m}" for m in LLAMA_MODES]
ROOT = Path(__file__).resolve().parent.parent
EXPERIMENT = "serve-load"


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--bundle", default="bundles/smollm2-b8-q41")
    opening.add_out(parser)
    parser.add_argument("--backend", default="onnxruntime", help="the servers' --backend (onnxruntime, native, auto)")
    parser.add_argument("--threads", type=int, default=None, help="the servers' --threads (default: theirs)")
    parser.add_argument("--requests", type=int, default=50, help="requests per (mode, concurrency)")
    parser.add_argument("--concurrency", default="1,2,4,8")
    parser.add_argument("--repeats", type=int, default=3, help="spells per (mode, C), interleaved across modes")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--modes", default="plain,fixed,adaptive")
    parser.add_argument("--max-batch", type=int, default=None, help="the servers' rows (default: the bundle's)")
    parser.add_argument("--gamma", type=int, default=None, help="γ of the fixed mode (default: the bundle's)")
    parser.add_argument("--drafter", default="auto",
                        help="the requests' drafter (specdec extension; default auto, what a request naming none "
                             "gets)")
    parser.add_argument("--timeout", type=float, default=300.0, help="per request, seconds")
    parser.add_argument("--prefix-reuse", choices=("on", "off"), default="on",
                        help="a slot's K/V of the previous request's prompt reused by the next (both servers' default)")
    parser.add_argument("--llama-modes", default="none",
                        help=f"llama.cpp peer servers, comma-separated among {', '.join(LLAMA_MODES)} (default none)")
    parser.add_argument("--llama-draft", default=None, help="llama.cpp's draft GGUF (default: the default Q4_1 GGUF)")
    args = parser.parse_args(argv)
    if args.max_batch is None:
        from specdec.errors import SpecDecError
        from specdec.manifest import read_manifest

        try:
            args.max_batch = read_manifest(args.bundle).target.max_batch
        except SpecDecError as exc:
            parser.error(str(exc))
    return args


def load_prompts() -> list:
    prompts = []
    for path in sorted((ROOT / "benchmarks" / "prompts").glob("*.jsonl")):
        prompts += [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    return prompts


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Server:
    """`specdec serve` in its own process on 127.0.0.1, with its RSS sampled every second."""

    def __init__(self, mode: str, args: argparse.Namespace):
        self.mode, self.args = mode, args
        self.extra = {"specdec": {"drafter": args.drafter}}  # the requests' extension fields
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.process = None
        self.rss = []  # (seconds since start, bytes)
        self._stop = threading.Event()

    def start(self) -> "Server":
        command = [sys.executable, "-m", "specdec.cli", "serve", self.args.bundle, "--port", str(self.port),
                   "--max-batch", str(self.args.max_batch), "--max-queue", "256", "--speculation", MODES[self.mode],
                   "--backend", self.args.backend, "--no-verify"]
        command += ["--gamma", str(self.args.gamma)] if self.args.gamma else []
        command += ["--threads", str(self.args.threads)] if self.args.threads else []
        command += [] if self.args.prefix_reuse == "on" else ["--no-prefix-reuse"]
        self.errors = tempfile.TemporaryFile()  # the server's stderr: its last line says why it stopped
        self.process = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=self.errors)
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                self.errors.seek(0)
                said = self.errors.read().decode("utf-8", "replace").strip().splitlines()
                raise RuntimeError(f"the {self.mode} server exited with {self.process.returncode}: "
                                   + (" / ".join(said[-2:]) if said else "it wrote nothing"))
            try:
                if httpx.get(self.url + "/health", timeout=5).status_code == 200:
                    self._watch()
                    return self
            except httpx.TransportError:
                time.sleep(0.5)
        raise RuntimeError(f"the {self.mode} server did not start")

    def _watch(self) -> None:
        threading.Thread(target=self._sample, daemon=True).start()

    def _sample(self) -> None:
        process, started = psutil.Process(self.process.pid), time.monotonic()
        while not self._stop.wait(1.0):
            try:
                self.rss.append((time.monotonic() - started, process.memory_info().rss))
            except psutil.Error:
                return

    def counts(self) -> dict:
        """The server's counters so far: rounds by γ (int keys), and "prompt" tokens, of them "reused" from a slot."""
        text = httpx.get(self.url + "/metrics", timeout=30).text
        counts = {int(g): float(n) for g, n in re.findall(r'specdec_rounds_total\{gamma="(\d+)"\} ([0-9.e+]+)', text)}
        for key, name in (("prompt", "specdec_prompt_tokens_total"), ("reused", "specdec_prompt_tokens_reused_total")):
            found = re.search(rf"^{name} ([0-9.e+]+)$", text, re.M)
            counts[key] = float(found.group(1)) if found else 0.0
        return counts

    def stop(self) -> None:
        self._stop.set()
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            self.process.wait(timeout=60)


class LlamaServe(Server):
    """llama.cpp's llama-server as a peer server: -np = the highest concurrency, continuous batching."""

    def __init__(self, mode: str, args: argparse.Namespace):
        super().__init__(mode, args)
        self.extra = {"cache_prompt": args.prefix_reuse == "on"}  # llama-server's reuse of its slot's prompt prefix
        self.server = None

    def settings(self):
        from peers import llamacpp_peer as lc

        draft = Path(self.args.llama_draft) if self.args.llama_draft else lc.default_gguf()
        spec = {"plain": lc.Plain(), "ngram": lc.BEST_NGRAM, "draft": lc.Draft(draft)}[self.mode.split()[-1]]
        parallel = max(int(c) for c in self.args.concurrency.split(","))
        return lc.ServerSettings(lc.default_gguf(), spec, threads=self.args.threads or 0, parallel=parallel)

    def start(self) -> "LlamaServe":
        from peers import llamacpp_peer as lc

        log = lc.peers_dir() / "llama.cpp" / f"serve-{self.mode.split()[-1]}.log"
        self.server = lc.LlamaServer(self.settings(), max_s=6 * 3600, log=log).start()
        self.process, self.url = self.server.process, self.server.url
        self._watch()
        return self

    def counts(self) -> dict:
        return {}

    def stop(self) -> None:
        self._stop.set()
        if self.server is not None:
            self.server.close()


async def one_request(client: httpx.AsyncClient, url: str, prompt: dict, args, extra: dict) -> dict:
    body = {"model": Path(args.bundle).resolve().name, "messages": [{"role": "user", "content": prompt["prompt"]}],
            "max_tokens": args.max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, **extra}
    record = {"prompt_id": prompt["id"], "status": 0, "tokens": 0, "text": "", "error": ""}
    pieces = []
    with timer.Request() as clock:
        try:
            async with client.stream("POST", url + "/v1/chat/completions", json=body,
                                     timeout=args.timeout) as response:
                record["status"] = response.status_code
                async for line in response.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        record["error"] = chunk["error"]["message"]
                    for choice in chunk.get("choices", []):
                        if choice["delta"].get("content"):
                            clock.arrived()
                            pieces.append(choice["delta"]["content"])
                    record["tokens"] = (chunk.get("usage") or {}).get("completion_tokens", record["tokens"])
        except httpx.HTTPError as exc:
            record["error"] = type(exc).__name__
    record.update(text="".join(pieces), **clock.times(record["tokens"]))
    record["ok"] = record["status"] == 200 and not record["error"] and record["tokens"] > 0
    return record


async def run_phase(server: Server, prompts: list, concurrency: int, count: int, args) -> tuple[list, float]:
    """`count` requests from `concurrency` closed-loop clients; -> (records, wall seconds)."""
    records, next_index = [None] * count, iter(range(count))

    async def worker(client):
        for index in next_index:
            records[index] = await one_request(client, server.url, prompts[index % len(prompts)], args, server.extra)

    limits = httpx.Limits(max_connections=concurrency + 2, max_keepalive_connections=concurrency + 2)
    async with httpx.AsyncClient(limits=limits) as client:
        started = time.perf_counter()
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))
        return records, time.perf_counter() - started


def _pct(values, q) -> float:
    values = [v for v in values if v == v]
    return float(np.percentile(values, q)) if values else float("nan")


def summarize(mode: str, concurrency: int, records: list, wall: float, gammas: dict, rss_mb: float) -> dict:
    ok = [r for r in records if r["ok"]]
    prompt, reused = gammas.pop("prompt", 0.0), gammas.pop("reused", 0.0)
    rounds = sum(gammas.values()) or 1.0
    return {
        "mode": mode, "concurrency": concurrency, "requests": len(records), "errors": len(records) - len(ok),
        "ttft_p50_ms": 1e3 * _pct([r["ttft_s"] for r in ok], 50), "ttft_p90_ms": 1e3 * _pct([r["ttft_s"] for r in ok], 90),
        "tpot_p50_ms": 1e3 * _pct([r["tpot_s"] for r in ok], 50), "tpot_p90_ms": 1e3 * _pct([r["tpot_s"] for r in ok], 90),
        "tokens": sum(r["tokens"] for r in ok), "wall_s": wall,
        "tokens_per_s": sum(r["tokens"] for r in ok) / wall if wall else 0.0,
        "gamma0_share": gammas.get(0, 0.0) / rounds if gammas else float("nan"),  # nan: no count (llama.cpp)
        "mean_gamma": sum(g * n for g, n in gammas.items()) / rounds if gammas else float("nan"),
        "rss_mb": rss_mb,
        "prompt_reused_share": reused / prompt if prompt else float("nan"),  # nan: no count (llama.cpp)
    }


def _delta(after: dict, before: dict) -> dict:
    return {g: n - before.get(g, 0.0) for g, n in after.items() if n - before.get(g, 0.0) > 0}


def warm_up(servers: dict, prompts: list, args) -> None:
    """One request alone, then max_batch together, on every server (allocates what the run will use). The warm-up's
    prompts are the last max_batch of the list, none of the measured requests' where the list is long enough: a
    slot that kept a measured prompt's K/V would let that request skip its whole prefill."""
    spare = prompts[-args.max_batch:] if len(prompts) >= args.requests + args.max_batch else prompts
    for server in servers.values():
        asyncio.run(run_phase(server, spare, 1, 1, args))
        asyncio.run(run_phase(server, spare, args.max_batch, args.max_batch, args))


def run_all(servers: dict, prompts: list, args) -> tuple[list, list]:
    """For each C, `--repeats` rounds; in each, every mode in turn (the order rotates) serves the same slice of the
    requests, so a mode's numbers pool several spells spread over the phase (one long spell per mode measured
    10-15 % apart for identical work on a 2-core machine)."""
    requests, summary = [], []
    levels = [int(c) for c in args.concurrency.split(",")]
    share = max(1, args.requests // args.repeats)
    for step, concurrency in enumerate(levels):
        pooled = {mode: ([], 0.0, {}, []) for mode in servers}  # records, wall, γ counts, tokens/s per spell
        for repeat in range(args.repeats):
            turn = step + repeat
            order = list(servers)[turn % len(servers):] + list(servers)[: turn % len(servers)]
            part = prompts[repeat * share:] + prompts[: repeat * share]
            for mode in order:
                server = servers[mode]
                before = server.counts()
                records, wall = asyncio.run(run_phase(server, part, concurrency, share, args))
                records_so_far, wall_so_far, gammas, spells = pooled[mode]
                for key, count in _delta(server.counts(), before).items():
                    gammas[key] = gammas.get(key, 0.0) + count
                spells.append(sum(r["tokens"] for r in records if r["ok"]) / wall if wall else 0.0)
                pooled[mode] = (records_so_far + records, wall_so_far + wall, gammas, spells)
        for mode, (records, wall, gammas, spells) in pooled.items():
            server = servers[mode]
            rss = server.rss[-1][1] / 2**20 if server.rss else float("nan")
            summary.append(summarize(mode, concurrency, records, wall, gammas, rss))
            summary[-1]["spells_tokens_per_s"] = " ".join(f"{x:.1f}" for x in spells)
            requests += [{"mode": mode, "concurrency": concurrency, **r} for r in records]
            row = summary[-1]
            print(f"{mode:9s} C={concurrency}: {row['tokens_per_s']:.1f} tok/s (spells {row['spells_tokens_per_s']}), "
                  f"TPOT p50 {row['tpot_p50_ms']:.1f} ms, TTFT p50 {row['ttft_p50_ms']:.0f} ms, errors {row['errors']}, "
                  f"γ=0 share {row['gamma0_share']:.2f}", flush=True)
    return requests, summary


def identical_outputs(requests: list, system: str = "specdec") -> tuple[int, int]:
    """(prompts whose greedy text is the same in every mode and concurrency of `system`, prompts compared)."""
    texts = {}
    for r in requests:
        if r["ok"] and (r["mode"].startswith("llama.cpp") == (system == "llama.cpp")):
            texts.setdefault(r["prompt_id"], set()).add(r["text"])
    return sum(len(t) == 1 for t in texts.values()), len(texts)


def markdown(summary: list) -> str:
    header = ["mode", "C", "requests", "errors", "TTFT p50 ms", "TTFT p90 ms", "TPOT p50 ms", "TPOT p90 ms",
              "tokens/s", "γ=0 rounds", "mean γ", "prompt tokens reused", "RSS MB", "tokens/s per spell"]
    rows = [[s["mode"], s["concurrency"], s["requests"], s["errors"], f"{s['ttft_p50_ms']:.0f}",
             f"{s['ttft_p90_ms']:.0f}", f"{s['tpot_p50_ms']:.1f}", f"{s['tpot_p90_ms']:.1f}",
             f"{s['tokens_per_s']:.1f}", f"{100 * s['gamma0_share']:.0f}%", f"{s['mean_gamma']:.2f}",
             f"{100 * s['prompt_reused_share']:.0f}%", f"{s['rss_mb']:.0f}", s.get("spells_tokens_per_s", "")]
            for s in sorted(summary, key=lambda s: (ORDER.index(s["mode"]), s["concurrency"]))]
    return tables.markdown(header, rows)


def plot(summary: list, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for mode in ORDER:
        rows = sorted((s for s in summary if s["mode"] == mode), key=lambda s: s["concurrency"])
        if rows:
            levels = [s["concurrency"] for s in rows]
            left.plot(levels, [s["tokens_per_s"] for s in rows], marker="o", label=mode)
            right.plot(levels, [s["tpot_p50_ms"] for s in rows], marker="o", label=mode)
    left.set(xlabel="concurrency", ylabel="aggregate tokens/s", title="throughput")
    right.set(xlabel="concurrency", ylabel="TPOT p50 (ms)", title="time per output token")
    for axis in (left, right):
        axis.set_xscale("log", base=2)
        axis.grid(alpha=0.3)
        axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def server_settings(args, modes: list) -> dict:
    return {mode: {"speculation": MODES[mode], "backend": args.backend, "max_batch": args.max_batch, "gamma":
                   args.gamma, "threads": args.threads, "prefix_reuse": args.prefix_reuse,
                   "requests": f"streamed greedy chat, drafter {args.drafter}, "
                   f"max_tokens {args.max_tokens}"} for mode in modes}


def chosen_modes(args) -> tuple[list, list]:
    """(specdec's modes, llama.cpp's), checked; 'none' for either means no server of that kind."""
    ours = [m.strip() for m in args.modes.split(",") if m.strip() and m.strip() != "none"]
    llama = [m.strip() for m in args.llama_modes.split(",") if m.strip() and m.strip() != "none"]
    for given, known in ((ours, list(MODES)), (llama, list(LLAMA_MODES))):
        unknown = [m for m in given if m not in known]
        if unknown:
            raise SystemExit(f"unknown mode {unknown[0]!r}; choose from {', '.join(known)} or none")
    if not ours + llama:
        raise SystemExit("no server to measure: pass --modes or --llama-modes")
    return ours, llama


def main(argv=None) -> int:
    args = parse_args(argv)
    ours, llama = chosen_modes(args)
    run = record.run_record(EXPERIMENT, server_settings(args, ours), args.threads, __file__, argv,
                            concurrency=args.concurrency, repeats=args.repeats, requests=args.requests)
    prompts = load_prompts()
    servers = {}
    try:
        for mode in ours:
            servers[mode] = Server(mode, args).start()  # one at a time: each measures its costs on a quiet machine
        for mode in llama:
            server = servers[f"llama.cpp {mode}"] = LlamaServe(f"llama.cpp {mode}", args).start()
            run["settings"][server.mode] = dict(server.server.settings.describe(), requests="streamed greedy chat "
                                                f"(its OpenAI-compatible endpoint), cache_prompt "
                                                f"{'true' if args.prefix_reuse == 'on' else 'false'}, max_tokens "
                                                f"{args.max_tokens}")
        warm_up(servers, prompts, args)
        rss_start = {mode: s.rss[-1][1] / 2**20 if s.rss else float("nan") for mode, s in servers.items()}
        requests, summary = run_all(servers, prompts, args)
        rss_end = {mode: s.rss[-1][1] / 2**20 if s.rss else float("nan") for mode, s in servers.items()}
    finally:
        for server in servers.values():
            server.stop()
    same = {system: identical_outputs(requests, system) for system in ("specdec", "llama.cpp")}
    out = record.run_dir(EXPERIMENT, run, args.out)
    plot(summary, out / "throughput.png")
    shown = (f"{markdown(summary)}\nidentical greedy outputs across modes and concurrency (specdec, llama.cpp): "
             f"{same}; RSS MB {rss_start} -> {rss_end}")
    record.finish(run, out, {"requests.csv": requests, "summary.csv": summary, "summary.md": markdown(summary)},
                  shown=shown, identical_greedy_outputs=same["specdec"],
                  identical_greedy_outputs_llama=same["llama.cpp"], rss_mb_after_warmup=rss_start, rss_mb_end=rss_end)
    return 0


if __name__ == "__main__":
    sys.exit(main())
