"""Peer: OpenVINO GenAI's LLMPipeline on CPU (benchmarks/.peers/openvino, made by setup_openvino.sh).

The models are optimum-intel's exports of the dequantized checkpoint every peer shares (prepare_hf.py's hf-fp32):
int4 (NNCF, asymmetric, groups of 32, every ratio-defining layer in 4 bits), int8 (weights only, per channel) and
fp16. None holds Q4_1's weights exactly: Q4_1 stores a scale and a minimum per 32 weights, and NNCF's asymmetric
int4 an integer zero point, so the int4 export rounds every weight again (fp16 and int8 round less); OpenVINO GenAI's
greedy output therefore differs from specdec's, and lockstep reports token agreement beside its numbers.

Its documented CPU latency tuning (OpenVINO's LLM guides): PERFORMANCE_HINT LATENCY, NUM_STREAMS 1,
INFERENCE_NUM_THREADS = cores, KV_CACHE_PRECISION u8, DYNAMIC_QUANTIZATION_GROUP_SIZE 32, CACHE_DIR ''; the worker
compiles the target once with them and writes what the CPU plugin says is in effect (inference precision: bf16 where
the CPU has AMX or AVX512-BF16, else f32) into the record. The pipeline is its default on CPU, continuous batching
(paged attention), which its speculative modes require; the scheduler keeps no prefix cache between requests, so
every request pays its own prefill (as llama.cpp's cache_prompt false and specdec's Generator).

Modes (all greedy, the prompt passed as the same token ids the other systems get, as TokenizedInputs):
  plain   LLMPipeline(model, "CPU")
  draft   its speculative decoding with a draft model (`draft_model(dir)`, num_assistant_tokens per round); the
          default draft is the int4 export of the same model: SmolLM2-135M is the smallest model of its tokenizer,
          so its lower-precision copy is the draft a user has (for the fp16 or int8 target; the int4 target
          drafting for itself only shows what a round costs)
  lookup  its prompt lookup decoding (`prompt_lookup=True`, num_assistant_tokens, max_ngram_size)

Times, as lockstep takes ortgenai's: the client's wall clock around `generate`; TTFT up to the streamer's first
token (it comes from the prefill's logits), TPOT the time after it over the tokens after the first. OpenVINO's own
perf metrics TTFT goes into `prefill_s` as a cross-check.

    python benchmarks/peers/openvino_peer.py --worker --models M --precision int4 --modes plain,lookup
    # lockstep.py's worker: one request per stdin line, one JSONL record per stdout line (peer_common.record)

Stdlib only at import, so lockstep.py and the tests import it in specdec's own process.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SYSTEM = "OpenVINO GenAI"
PRECISIONS = ("int4", "int8", "fp16")
VENV = "openvino"
# what optimum-cli ran for each export (setup_openvino.sh reads these too: one place for the flags)
EXPORT_FLAGS = {"int4": ["--weight-format", "int4", "--group-size", "32", "--ratio", "1.0"],  # asymmetric: no --sym
                "int8": ["--weight-format", "int8"], "fp16": ["--weight-format", "fp16"]}
NOT_EXACT = ("its weights are optimum-intel's export of the dequantized Q4_1 checkpoint, rounded again "
             "(int4: NNCF asymmetric groups of 32 with integer zero points cannot hold Q4_1's fractional minimums; "
             "int8 and fp16 round less), and its CPU plugin computes in its inference precision: its greedy output "
             "is not expected to equal specdec's; compare token agreement, not identity")


def peers_dir() -> Path:
    return Path(os.environ.get("SPECDEC_PEERS_DIR", ROOT / "benchmarks" / ".peers"))


def python(peers: Path | None = None) -> Path:
    return Path(peers or peers_dir()) / VENV / "bin" / "python"


def installed(peers: Path | None = None) -> bool:
    return python(peers).is_file() and os.access(python(peers), os.X_OK)


def model_dir(precision: str, peers: Path | None = None) -> Path:
    return Path(peers or peers_dir()) / "models" / f"openvino-{precision}"


def cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


# --- modes: each knows its pipeline options, its per-request options, its label and its settings for the record -----

@dataclass(frozen=True)
class Plain:
    drafter = "none"
    gamma = 0

    @property
    def name(self) -> str:
        return "target-only"

    def pipeline_options(self, ov_genai, plugin: dict) -> dict:
        return {}

    def configure(self, config) -> None:
        pass

    def describe(self) -> dict:
        return {"speculation": "none"}


@dataclass(frozen=True)
class Draft:
    """`draft_model(dir)`: the draft proposes `assistant_tokens` tokens a round (num_assistant_tokens; its default
    5), used as is by the continuous-batching pipeline."""
    model: Path
    assistant_tokens: int = 5
    drafter = "model"

    @property
    def gamma(self) -> int:
        return self.assistant_tokens

    @property
    def name(self) -> str:
        return f"draft {Path(self.model).name} k={self.assistant_tokens}"

    def pipeline_options(self, ov_genai, plugin: dict) -> dict:
        return {"draft_model": ov_genai.draft_model(str(self.model), "CPU", **plugin)}

    def configure(self, config) -> None:
        config.num_assistant_tokens = self.assistant_tokens

    def describe(self) -> dict:
        return {"speculation": "draft_model", "draft_model": Path(self.model).name,
                "num_assistant_tokens": self.assistant_tokens, "draft_plugin_config": "the target's"}


@dataclass(frozen=True)
class Lookup:
    """`prompt_lookup=True`: the last up to `max_ngram_size` tokens looked up in the prompt and output so far, the
    `assistant_tokens` tokens after a match proposed (its docs' example: 5 and 3)."""
    assistant_tokens: int = 5
    max_ngram_size: int = 3
    drafter = "prompt_lookup"

    @property
    def gamma(self) -> int:
        return self.assistant_tokens

    @property
    def name(self) -> str:
        return f"n-gram prompt lookup k={self.assistant_tokens} ngram={self.max_ngram_size}"

    def pipeline_options(self, ov_genai, plugin: dict) -> dict:
        return {"prompt_lookup": True}

    def configure(self, config) -> None:
        config.num_assistant_tokens = self.assistant_tokens
        config.max_ngram_size = self.max_ngram_size

    def describe(self) -> dict:
        return {"speculation": "prompt_lookup", "num_assistant_tokens": self.assistant_tokens,
                "max_ngram_size": self.max_ngram_size}


MODES = ("plain", "draft", "lookup")  # the names lockstep's --ov-modes takes, in Settings.kinds


@dataclass(frozen=True)
class Settings:
    """One worker: the export it runs (precision), its modes, threads (0: cores), the draft model for `draft`
    (None: the int4 export), the speculative sizes, and whether EOS ends a request."""
    peers: Path
    precision: str = "int4"
    modes: tuple = ("plain",)
    threads: int = 0
    draft: Path | None = None
    assistant_tokens: int = 5
    max_ngram_size: int = 3
    ignore_eos: bool = False

    def __post_init__(self):
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision {self.precision!r} is not one of {', '.join(PRECISIONS)}")
        unknown = [m for m in self.modes if m not in MODES]
        if unknown or not self.modes:
            raise ValueError(f"mode {unknown[0] if unknown else None!r} is not one of {', '.join(MODES)}")
        if self.threads < 0 or self.assistant_tokens < 1 or self.max_ngram_size < 1:
            raise ValueError(f"need threads >= 0, assistant tokens >= 1, max ngram size >= 1; got {self.threads}, "
                             f"{self.assistant_tokens}, {self.max_ngram_size}")

    @property
    def n_threads(self) -> int:
        return self.threads or cores()

    @property
    def model(self) -> Path:
        return model_dir(self.precision, self.peers)

    @property
    def draft_model(self) -> Path:
        return Path(self.draft) if self.draft else model_dir("int4", self.peers)

    def kinds(self) -> dict:
        """{mode name: its kind}, in the order asked."""
        made = {"plain": lambda: Plain(), "draft": lambda: Draft(self.draft_model, self.assistant_tokens),
                "lookup": lambda: Lookup(self.assistant_tokens, self.max_ngram_size)}
        return {name: made[name]() for name in self.modes}

    def plugin_config(self) -> dict:
        """The CPU plugin's properties, as OpenVINO's LLM guides tell a CPU user to set them for latency."""
        return {"PERFORMANCE_HINT": "LATENCY", "NUM_STREAMS": "1", "INFERENCE_NUM_THREADS": self.n_threads,
                "KV_CACHE_PRECISION": "u8", "DYNAMIC_QUANTIZATION_GROUP_SIZE": "32", "CACHE_DIR": ""}

    def describe(self) -> dict:
        """What a record needs before the worker runs; the worker adds versions and what is in effect."""
        return {"system": SYSTEM, "model": _in_repo(self.model), "precision": self.precision,
                "threads": self.n_threads, "plugin_config": self.plugin_config(), "ignore_eos": self.ignore_eos,
                "scheduler": "continuous batching, prefix caching off, max_num_batched_tokens unbounded",
                "requests": "TokenizedInputs of the same token ids, greedy, one at a time", "note": NOT_EXACT}

    @property
    def row_note(self) -> str:
        return f"its {self.precision} export, not specdec's weights bit for bit: read token agreement"

    def worker_args(self) -> list:
        args = ["--worker", "--peers", str(self.peers), "--precision", self.precision, "--modes", ",".join(self.modes),
                "--threads", str(self.threads), "--assistant-tokens", str(self.assistant_tokens),
                "--max-ngram-size", str(self.max_ngram_size)]
        args += ["--draft", str(self.draft)] if self.draft else []
        return args + (["--ignore-eos"] if self.ignore_eos else [])

    def command(self) -> list:
        return [str(python(self.peers)), str(Path(__file__).resolve()), *self.worker_args()]


def settings_from_args(argv: list) -> Settings:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker", action="store_true", required=True)
    parser.add_argument("--peers", default=str(peers_dir()))
    parser.add_argument("--precision", default="int4", choices=PRECISIONS)
    parser.add_argument("--modes", default="plain")
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--draft", default=None)
    parser.add_argument("--assistant-tokens", type=int, default=5)
    parser.add_argument("--max-ngram-size", type=int, default=3)
    parser.add_argument("--ignore-eos", action="store_true")
    args = parser.parse_args(argv)
    return Settings(Path(args.peers), args.precision, tuple(m.strip() for m in args.modes.split(",") if m.strip()),
                    args.threads, Path(args.draft) if args.draft else None, args.assistant_tokens,
                    args.max_ngram_size, args.ignore_eos)


def _in_repo(path) -> str:
    """A path as a record writes it: relative to the repository where it lies inside, else its name."""
    path = Path(path).resolve()
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else path.name


def record_settings(settings: Settings, hello: dict) -> dict:
    """The record's settings of the system: what the page shows on one line (the version, the precision it ran, what
    its plugin says is in effect), the nested tables in record.json, and a line per mode."""
    effect = hello.get("in_effect", {})
    shown = {"version": hello.get("versions", {}).get("openvino_genai", "?"),
             "inference_precision": effect.get("INFERENCE_PRECISION_HINT", "?"),
             "kv_cache_precision": effect.get("KV_CACHE_PRECISION", "?"),
             "dynamic_quantization_group_size": effect.get("DYNAMIC_QUANTIZATION_GROUP_SIZE", "?")}
    described = settings.describe()
    nested = {"versions": hello.get("versions", {}), "in_effect": effect, "export": hello.get("export", {})}
    if "draft_export" in hello:
        nested["draft_export"] = hello["draft_export"]
    return described | shown | nested | {"modes": hello.get("notes", {})}


def export_of(folder: Path) -> dict:
    """How setup_openvino.sh made an export: export.json (the command, the versions, NNCF's bitwidth table; optimum's
    own openvino_config.json holds the machine's paths and, for CLI flags, no more than "default")."""
    path = Path(folder) / "export.json"
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {"note": "no export.json"}


def row(kind, prompt: dict, repeat: int, ids: list, tokens: list, ttft: float, e2e: float, stats: dict,
        note: str = "") -> dict:
    """One request in the table's columns (specdec.bench.table.COLUMNS), as peer_common.record writes them."""
    new = len(tokens)
    proposed, accepted, passes = stats.get("proposed"), stats.get("accepted"), stats.get("verify_passes")
    return dict(system=SYSTEM, mode=kind.name, drafter=kind.drafter, gamma=kind.gamma, note=note, status="ok",
                prompt_id=prompt["id"], cls=prompt["class"], repeat=repeat, seed=0, prompt_tokens=len(ids),
                new_tokens=new, ttft_s=ttft, e2e_s=e2e, tpot_s=(e2e - ttft) / (new - 1) if new > 1 else 0.0,
                tokens_per_s=new / e2e if e2e else 0.0, prefill_s=stats.get("own_ttft_s"), proposed=proposed,
                accepted=accepted, acceptance_rate=accepted / proposed if proposed else None, verify_passes=passes,
                drafted_rounds=passes if proposed else None, mean_acceptance_length=new / passes if passes else None,
                token_ids=[int(t) for t in tokens])


def failed(kind, prompt: dict, repeat: int, note: str) -> dict:
    return dict(system=SYSTEM, mode=kind.name, drafter=kind.drafter, gamma=kind.gamma, status="failed",
                note=note[:400], prompt_id=prompt["id"], cls=prompt["class"], repeat=repeat)


# --- the worker: runs in the OpenVINO venv ----------------------------------------------------------------------------

IN_EFFECT = ("INFERENCE_PRECISION_HINT", "KV_CACHE_PRECISION", "KEY_CACHE_PRECISION", "VALUE_CACHE_PRECISION",
             "KEY_CACHE_GROUP_SIZE", "VALUE_CACHE_GROUP_SIZE", "DYNAMIC_QUANTIZATION_GROUP_SIZE",
             "INFERENCE_NUM_THREADS", "NUM_STREAMS", "PERFORMANCE_HINT", "EXECUTION_MODE_HINT",
             "ENABLE_HYPER_THREADING", "ENABLE_CPU_PINNING", "SCHEDULING_CORE_TYPE")


def in_effect(ov, settings: Settings) -> dict:
    """The CPU plugin's properties once the target's IR is compiled with the plugin config: what it ran with."""
    compiled = ov.Core().compile_model(str(settings.model / "openvino_model.xml"), "CPU", settings.plugin_config())
    found = {}
    for key in IN_EFFECT:
        try:
            value = compiled.get_property(key)
        except RuntimeError:  # a property this version does not have
            continue
        found[key] = value.get_type_name() if isinstance(value, ov.Type) else str(value)
    return found


def scheduler(ov_genai):
    config = ov_genai.SchedulerConfig()
    config.enable_prefix_caching = False  # every request pays its own prefill
    config.max_num_batched_tokens = 2 ** 31 - 1  # a prompt in one pass, as its latency-oriented default
    return config


def open_pipelines(ov_genai, settings: Settings) -> tuple:
    """({mode: (kind, pipeline or None)}, {mode: note}); a mode the installed version refuses keeps its error."""
    plugin, opened, notes = settings.plugin_config(), {}, {}
    for name, kind in settings.kinds().items():
        described = kind.describe() | {"mode": kind.name}
        try:
            pipe = ov_genai.LLMPipeline(str(settings.model), "CPU", scheduler_config=scheduler(ov_genai),
                                        **kind.pipeline_options(ov_genai, plugin), **plugin)
        except Exception as exc:  # noqa: BLE001 - reported as failed, never left out
            pipe, described["failed"] = None, f"{type(exc).__name__}: {exc}"[:400]
        opened[name], notes[name] = (kind, pipe), described
    return opened, notes


class FirstToken:
    """A streamer that notes when the first token arrives (its class is made from ov_genai.StreamerBase)."""

    @staticmethod
    def make(ov_genai):
        class Streamer(ov_genai.StreamerBase):
            def __init__(self):
                super().__init__()
                self.first = None

            def write(self, token):
                if self.first is None:
                    self.first = time.perf_counter()
                return ov_genai.StreamingStatus.RUNNING

            def end(self):
                pass

        return Streamer()


def generate(ov, ov_genai, np, pipe, kind, ids: list, new_tokens: int, ignore_eos: bool) -> tuple:
    """One greedy request -> (new tokens, ttft_s, e2e_s, stats)."""
    config = pipe.get_generation_config()
    config.max_new_tokens, config.do_sample, config.ignore_eos = new_tokens, False, ignore_eos
    if ignore_eos:
        config.stop_token_ids = set()
    kind.configure(config)
    tensor = np.asarray([ids], dtype=np.int64)
    inputs = ov_genai.TokenizedInputs(ov.Tensor(tensor), ov.Tensor(np.ones_like(tensor)))
    streamer = FirstToken.make(ov_genai)
    started = time.perf_counter()
    result = pipe.generate(inputs, config, streamer)
    e2e = time.perf_counter() - started
    tokens = list(result.tokens[0])
    stats = {"own_ttft_s": result.perf_metrics.get_ttft().mean / 1e3}
    if kind.drafter != "none":
        stats |= speculative_stats(result, kind)
    return tokens, (streamer.first or started + e2e) - started, e2e, stats


def speculative_stats(result, kind) -> dict:
    """From its raw metrics' tokens per target pass (the first pass is the prefill's, one token): the passes after
    it, and the drafts they accepted (a pass gives its own token and the accepted ones). A draft model drafts
    num_assistant_tokens every round (the continuous-batching pipeline uses it as is), so its proposals are the
    rounds times that (a bound: the last round may draft fewer); prompt lookup's rounds without a match propose
    nothing, and it does not count them, so its proposals stay unknown."""
    sizes = [int(n) for n in result.perf_metrics.raw_metrics.m_batch_sizes]
    passes = len(sizes) - 1
    if passes < 1:
        return {}
    stats = {"verify_passes": passes}
    if isinstance(kind, Draft):
        stats |= {"accepted": sum(sizes[1:]) - passes, "proposed": passes * kind.assistant_tokens}
    return stats


def worker(settings: Settings) -> int:
    """lockstep.py's peer: reads {"mode", "ids", "new_tokens", "prompt", "repeat"} lines, answers one record per line
    (status "failed" with the error where a request fails); the first line it writes holds the settings."""
    import numpy as np
    import openvino as ov
    import openvino_genai as ov_genai

    opened, notes = open_pipelines(ov_genai, settings)
    for kind, pipe in opened.values():
        if pipe is not None:
            generate(ov, ov_genai, np, pipe, kind, [1, 2, 3], 4, True)  # warm-up
    versions = {"openvino": ov.__version__, "openvino_genai": ov_genai.__version__}
    hello = {"ready": True, "notes": notes, "versions": versions, "in_effect": in_effect(ov, settings),
             "export": export_of(settings.model)}
    if "draft" in opened:
        hello["draft_export"] = export_of(settings.draft_model)
    print(json.dumps(hello), flush=True)
    for line in sys.stdin:
        ask = json.loads(line)
        kind, pipe = opened[ask["mode"]]
        if pipe is None:
            answer = failed(kind, ask["prompt"], ask["repeat"], f"failed to open: {notes[ask['mode']]['failed']}")
        else:
            try:
                done = generate(ov, ov_genai, np, pipe, kind, ask["ids"], ask["new_tokens"], settings.ignore_eos)
                answer = row(kind, ask["prompt"], ask["repeat"], ask["ids"], *done, note=settings.row_note)
            except Exception as exc:  # noqa: BLE001 - a failed request is reported in the table, never dropped
                answer = failed(kind, ask["prompt"], ask["repeat"], f"failed: {type(exc).__name__}: {exc}")
        print(json.dumps(answer), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(worker(settings_from_args(sys.argv[1:])))
