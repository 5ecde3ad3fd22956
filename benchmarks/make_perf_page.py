"""Write docs/performance.md (and its plot) from the committed run records under benchmarks/results/. The page is
never edited by hand: change a run, then run this script; tests/docs checks that the committed page is its output.

    python benchmarks/make_perf_page.py            # writes docs/performance.md and docs/img/lockstep-tpot.png
    python benchmarks/make_perf_page.py --check    # exit 1 if docs/performance.md is not this script's output
    python benchmarks/make_perf_page.py --readme   # print the README's performance tables (newest lockstep runs)

Each section takes the newest run of its experiment (by the time its record says it started), and names the command
that makes it, its commit, the machine and each system's settings, as its record.json holds them. The suite against
peers gets one section per bundle it ran on (the default Q4_1 bundle, a bf16 checkpoint's bundle): each answers its
own question.
Reads markdown and CSV with the standard library only.
"""
from __future__ import annotations

import argparse
import csv
import fnmatch
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
PAGE = ROOT / "docs" / "performance.md"
IMAGES = ROOT / "docs" / "img"
PLOT = IMAGES / "lockstep-tpot.png"  # the default bundle's; another bundle's is lockstep-tpot-<bundle>.png
DEFAULT_BUNDLE = "smollm2-q41"
SECTIONS = ("lockstep", "serve-load", "contention", "open-cost", "rows", "step", "soak", "gamma-policies", "coupling",
            "drafts", "suite")


def committed_files(run: Path) -> list:
    """The files of a run folder that git keeps: not record.json (the page cites it already), and not what
    benchmarks/results/.gitignore keeps local (parquet copies), so the page reads the same on a fresh clone."""
    ignore = RESULTS / ".gitignore"
    patterns = [line.strip() for line in ignore.read_text(encoding="utf-8").splitlines()
                if line.strip() and not line.startswith("#")] if ignore.is_file() else []
    return [p for p in sorted(run.iterdir()) if p.name != "record.json"
            and not any(fnmatch.fnmatch(p.name, pattern) for pattern in patterns)]


def _started(run: Path) -> tuple:
    record = json.loads((run / "record.json").read_text(encoding="utf-8"))
    return record.get("started") or record.get("date") or "", run.name


def runs(experiment: str) -> list:
    """The run folders of an experiment, oldest first (by the start time in each record; folder names of one day
    sort by commit hash, not by time)."""
    folder = RESULTS / experiment
    return sorted((p for p in folder.iterdir() if (p / "record.json").is_file()), key=_started) \
        if folder.is_dir() else []


def newest(experiment: str) -> Path | None:
    found = runs(experiment)
    return found[-1] if found else None


def bundle_of(run: Path) -> str:
    """The bundle a run measured: the first argument after the script in its command."""
    words = record_of(run)["command"].split()
    script = next((i for i, w in enumerate(words) if w.endswith(".py") or w.startswith("benchmarks.")), 0)
    following = [w for w in words[script + 1:] if not w.startswith("-")]
    return Path(following[0]).name if following else "?"


def bundle_runs(experiment: str) -> list:
    """The newest run of an experiment for each bundle, the default bundle's first, then the newest first."""
    latest = {}
    for run in runs(experiment):
        latest[bundle_of(run)] = run
    newest_first = sorted(latest.values(), key=_started, reverse=True)
    return sorted(newest_first, key=lambda run: bundle_of(run) != DEFAULT_BUNDLE)  # a stable sort


def step_runs() -> list:
    """The default bundle's newest step run, then the newest of all where another bundle's is newer."""
    latest = bundle_runs("step")
    default = [run for run in latest[:1] if bundle_of(run) == DEFAULT_BUNDLE]
    newest_run = newest("step")
    return default + [newest_run] if newest_run is not None and newest_run not in default else default


def plot_path(run: Path) -> Path:
    bundle = bundle_of(run)
    return PLOT if bundle == DEFAULT_BUNDLE else IMAGES / f"lockstep-tpot-{bundle}.png"


def record_of(run: Path) -> dict:
    return json.loads((run / "record.json").read_text(encoding="utf-8"))


def rows_of(path: Path) -> list:
    with path.open(encoding="utf-8", newline="") as handle:
        return list(csv.DictReader(handle))


def rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def num(value, pattern: str = "{:.1f}") -> str:
    """A CSV cell formatted, or '–' where it is empty or not a number."""
    try:
        number = float(value)
    except (TypeError, ValueError):
        return "–"
    return "–" if number != number else pattern.format(number)


def table(header: list, rows: list) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(map(str, row)) + " |" for row in rows]) + "\n"


def provenance(run: Path) -> str:
    """Command, commit, machine and settings of a run, as its record holds them."""
    record = record_of(run)
    git, machine = record["git"], record["machine"]
    cpu = machine["cpu"]
    dirty = {True: ", with uncommitted changes", False: "", None: ""}[git.get("dirty")]
    flags = f", {' '.join(cpu['flags'])}" if cpu.get("flags") else ""
    then = " (as run then)" if record.get("provenance") else ""
    lines = [f"- command{then}: `{record['command']}`",
             f"- code: commit `{git['short']}`{dirty}; files: `{rel(run)}/`",
             f"- machine: {cpu['model']}, {cpu.get('usable_cpus') or cpu.get('logical_cpus')} CPUs{flags}; "
             f"{machine.get('os', '')}, Python {machine.get('python', '?')}"]
    for system, settings in record.get("settings", {}).items():
        lines += settings_lines(system, settings)
    if record.get("provenance"):
        lines.append(f"- record: {record['provenance']}")
    if record.get("equivalent_now"):
        lines.append(f"- the same question today: `{record['equivalent_now']}`")
    return "\n".join(lines) + "\n"


def settings_lines(system: str, settings: dict) -> list:
    """A system's settings as the page lists them: its `key value` pairs on one line (a nested table, such as a peer's
    version or a model's entry, stays in record.json). A peer run in several modes (settings["modes"]: {mode:
    settings}, as lockstep records llama.cpp) gets what its modes share on its own line and a line per mode with the
    rest, so its settings stand beside every table that shows its numbers."""
    modes = settings.get("modes")
    if not isinstance(modes, dict) or not modes or not all(isinstance(m, dict) for m in modes.values()):
        return [f"- {system}: {_pairs(settings)}"]
    first = next(iter(modes.values()))
    shared = {k: v for k, v in first.items() if len(modes) > 1 and all(k in m and m[k] == v for m in modes.values())}
    lines = [f"- {system}: {_pairs({k: v for k, v in settings.items() if k != 'modes'} | shared)}"]
    return lines + [f"    - {mode}: {_pairs({k: v for k, v in m.items() if k not in shared})}"
                    for mode, m in modes.items()]


def _pairs(settings: dict) -> str:
    pairs = "; ".join(f"{k} {v}" for k, v in settings.items() if not isinstance(v, dict))
    if pairs:
        return pairs
    return "record.json holds them only as nested tables" if settings else "the record did not store them"


# --- sections ------------------------------------------------------------------------------------------------------

def lockstep_rows(run: Path) -> list:
    return [r for r in rows_of(run / "summary.csv") if r["status"] == "ok"]


def readme_table(run: Path) -> str:
    """A README table: TPOT and TTFT of each (system, mode) of a lockstep run, and each one's speed against the
    first system's plain decoding."""
    rows = lockstep_rows(run)
    base = next((r for r in rows if r["mode"] == "target-only"), rows[0])
    cells = [[r["system"], r["mode"], num(r["tpot_mean_ms"]), num(r["ttft_p50_ms"], "{:.0f}"),
              num(r["speedup"], "{:.2f}×"), num(float(base["tpot_mean_ms"]) / float(r["tpot_mean_ms"]), "{:.2f}×")]
             for r in rows]
    return table(["system", "mode", "TPOT ms", "TTFT p50 ms", "speedup over its own plain",
                  f"speed against {base['system']} plain"], cells)


def lockstep_section(run: Path) -> str:
    def ours(r: dict, key: str, pattern: str) -> str:  # the prediction and its inputs exist for specdec's systems
        return num(r[key], pattern) if r["system"].startswith("specdec") else "–"

    rows = [[r["system"], r["mode"], r["requests"], num(r["tpot_mean_ms"]), num(r["ttft_p50_ms"], "{:.0f}"),
             num(r["speedup"], "{:.2f}×"), ours(r, "predicted_speedup", "{:.2f}×"), num(r["alpha"], "{:.2f}"),
             num(r["mean_acceptance_length"], "{:.2f}"), ours(r, "cost_ratio", "{:.3f}"),
             ours(r, "verify_ratio", "{:.2f}"), num(r["identical"], "{:.0%}")] for r in lockstep_rows(run)]
    pairs = (run / "pairs.md").read_text(encoding="utf-8").strip()
    return (f"## The suite against peers, request by request: {bundle_of(run)}\n\n"
            "Every (system, mode) takes its turn on a prompt before the next prompt starts. TPOT is token-weighted "
            "over the requests (time after each request's first token over the tokens after it); speedup is over the "
            "same system's plain decoding in this run; predicted is the speedup formula of the design page with α, c "
            "(draft time per drafted token over a verify pass) and r (a verify pass over a plain step) measured in "
            "this run; identical is the share of requests whose greedy output equals specdec's target-only output "
            "token for token.\n\n" + provenance(run) + "\n"
            + table(["system", "mode", "n", "TPOT ms", "TTFT p50 ms", "speedup", "predicted", "α", "mean acc. len",
                     "c", "r", "identical"], rows)
            + f"\n![TPOT by system and mode](img/{plot_path(run).name})\n\n"
            "Per-prompt ratios of TPOT:\n\n" + pairs + "\n")


NATIVE = {  # experiment: (title, what it asks, the table its script writes)
    "contention": ("Plain decoding beside other work",
                   "Time per token after the first, idle and beside N processes that each spin on one core, as the "
                   "slowdown against idle; every system takes its turn each round.", "contention.md"),
    "open-cost": ("Opening a bundle",
                  "`specdec.load` in a fresh process: seconds, and peak memory while opening against while "
                  "generating.", "open_cost.md"),
    "rows": ("Several rows in one call",
             "One forward pass of several rows, each at its own cache length, against the rows one call at a time.",
             "rows.md"),
    "step": ("One forward pass and its bandwidth floor",
             "A step, a long-context step and a verify pass of the target, against the time its weights take to "
             "stream at the bandwidth measured in the same run.", "step.md"),
}


def native_section(experiment: str, run: Path) -> str:
    title, question, name = NATIVE[experiment]
    if experiment == "step":  # one section per bundle shown
        title = f"{title}: {bundle_of(run)}"
    body = (run / name).read_text(encoding="utf-8").strip() if (run / name).is_file() else ""
    return f"## {title}\n\n{question}\n\n" + provenance(run) + "\n" + body + "\n"


def serve_section(run: Path) -> str:
    record = record_of(run)
    rows = [[r["mode"], r["concurrency"], r["requests"], r["errors"], num(r["ttft_p50_ms"], "{:.0f}"),
             num(r["tpot_p50_ms"]), num(r["tpot_p90_ms"]), num(r["tokens_per_s"]), num(r["gamma0_share"], "{:.0%}"),
             num(r["mean_gamma"], "{:.2f}"), num(r.get("prompt_reused_share", "nan"), "{:.0%}"),
             num(r["rss_mb"], "{:.0f}"), r.get("spells_tokens_per_s", "")]
            for r in rows_of(run / "summary.csv")]
    same = record.get("result", record).get("identical_greedy_outputs")
    exact = (f"Greedy outputs identical across modes and concurrencies: {same[0]} of {same[1]} prompts.\n\n"
             if same else "")
    return ("## Serving under load\n\n"
            "One `specdec serve` process per speculation mode; for each concurrency C, the modes take turns in "
            "interleaved spells of closed-loop clients sending streamed greedy chat requests. Tokens/s is completion "
            "tokens over wall time, pooled over the spells (each spell in the last column).\n\n"
            + provenance(run) + "\n" + exact
            + table(["mode", "C", "requests", "errors", "TTFT p50 ms", "TPOT p50 ms", "TPOT p90 ms", "tokens/s",
                     "γ=0 rounds", "mean γ", "prompt reused", "RSS MB", "tokens/s per spell"], rows) + "\n")


def soak_section(run: Path) -> str:
    result = record_of(run)["result"]
    return ("## Memory over a long run\n\n"
            "Requests cycle through every drafter, greedy and seeded sampling, batch 1 and 2, streamed and not, on "
            "one Generator; resident memory is sampled as it goes. The figure to watch is the growth after the "
            "warm-up, which gives both models every shape a request can bring.\n\n" + provenance(run) + "\n"
            + table(["RSS at start", "after warm-up", "at the end", "growth after warm-up"],
                    [[f"{result['rss_start_mib']:.1f} MiB", f"{result['rss_after_warmup_mib']:.1f} MiB",
                      f"{result['rss_end_mib']:.1f} MiB", f"{result['growth_after_warmup_pct']:+.2f} %"]]) + "\n")


def gamma_section(run: Path) -> str:
    rows = [[r["mode"], r["requests"], num(r["tpot_p50_ms"]), num(r["speedup"], "{:.2f}×"),
             num(r["predicted_speedup"], "{:.2f}×"), num(r["alpha"], "{:.2f}")]
            for r in rows_of(run / "summary.csv") if r["system"] == "specdec"]
    return ("## γ: fixed, calibrated and adaptive\n\n"
            "The model drafter at every γ and under the adaptive and heuristic γ policies, against target-only "
            "decoding, one bundle, one run (`specdec bench`).\n\n" + provenance(run) + "\n"
            + table(["mode", "n", "TPOT p50 ms", "speedup", "predicted", "α"], rows) + "\n")


def coupling_section(run: Path) -> str:
    text = (run / "coupling.md").read_text(encoding="utf-8").strip()
    return ("## What the gumbel coupling costs\n\n"
            "Sampled requests with the model drafter, Leviathan's acceptance rule against `coupling=\"gumbel\"` "
            "(noise fixed by seed, row and position, so a seed gives the same text whatever the drafter).\n\n"
            + provenance(run) + "\n" + text + "\n\n")


def drafts_section(run: Path) -> str:
    text = (run / "report.md").read_text(encoding="utf-8").strip()
    return ("## Drafts of the default model\n\n"
            "Every draft `specdec calibrate quantize` can make from SmolLM2-135M, against the fp32 target "
            "(`specdec calibrate report`): size, ms per step, top-1 agreement and perplexity on held-out text, and as "
            "a greedy model drafter at γ = 4 its acceptance, mean acceptance length and speedup. An older run than "
            "the sections above: read its ratios, not its milliseconds.\n\n" + provenance(run) + "\n" + text + "\n\n")


def suite_section(run: Path) -> str:
    lines = (run / "merged.md").read_text(encoding="utf-8").splitlines()
    body = [line for line in lines if line.startswith("|")]
    end = next((i for i, line in enumerate(body[2:], 2) if not line.startswith("| ")), len(body))
    header = [c.strip() for c in body[0].strip("|").split("|")]
    keep = [header.index(c) for c in ("system", "mode", "n", "TPOT p50 ms", "TTFT p50 ms", "speedup", "identical")]
    rows = [[[c.strip() for c in line.strip("|").split("|")][i] for i in keep] for line in body[2:end]]
    return ("## The sequential suite, with transformers\n\n"
            "Each system over the whole suite in turn, minutes apart: ratios between systems carry the machine's "
            "drift, so trust the request-by-request run above for those. This is the run with transformers as a "
            "peer (10 prompts; it is the slowest system).\n\n" + provenance(run) + "\n"
            + table(["system", "mode", "n", "TPOT p50 ms", "TTFT p50 ms", "speedup", "identical"], rows) + "\n")


def other_runs(cited: set) -> str:
    lines = ["## Other runs the docs cite\n",
             "Single questions, each answered once; the design choices page says what each one decided.\n"]
    for folder in sorted(p for p in RESULTS.iterdir() if p.is_dir()):
        for run in runs(folder.name):
            if run in cited:
                continue
            record = record_of(run)
            files = ", ".join(f"`{p.name}`" for p in committed_files(run))
            today = f"; the same question today: `{record['equivalent_now']}`" if record.get("equivalent_now") else ""
            lines.append(f"- **{folder.name}** (`{rel(run)}/`, commit `{record['git']['short']}`): "
                         f"`{record['command']}`; {files}{today}")
    return "\n".join(lines) + "\n"


RENDER = {"lockstep": lockstep_section, "serve-load": serve_section, "soak": soak_section,
          "gamma-policies": gamma_section, "coupling": coupling_section, "drafts": drafts_section,
          "suite": suite_section}


def render() -> str:
    head = ("<!-- Generated by benchmarks/make_perf_page.py from benchmarks/results/*/*/record.json. "
            "Do not edit: change a run, then run the script. -->\n\n# Performance\n\n"
            "Every table below is made from a committed run record: the command that makes it, the commit it "
            "measured, the machine, and each system's settings are written beside it. How the runs are made, and the "
            "rules they follow, are on the benchmarking page. The machine is a shared 2-core VM whose speed drifts "
            "between runs: read ratios within one run, not milliseconds across runs.\n\n")
    parts, cited = [head], set()
    for experiment in SECTIONS:
        chosen = (bundle_runs(experiment) if experiment == "lockstep" else step_runs() if experiment == "step"
                  else [r for r in [newest(experiment)] if r is not None])
        for run in chosen:
            cited.add(run)
            parts.append(RENDER[experiment](run) if experiment in RENDER else native_section(experiment, run))
    parts.append(other_runs(cited))
    return "\n".join(part.rstrip("\n") + "\n" for part in parts)


def plot(run: Path, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = lockstep_rows(run)
    labels = [f"{r['system']}\n{r['mode']}" for r in rows]
    values = [float(r["tpot_mean_ms"]) for r in rows]
    figure, axis = plt.subplots(figsize=(8, 3.6))
    axis.barh(labels[::-1], values[::-1], color="#4a78b5")
    for y, value in enumerate(values[::-1]):
        axis.text(value, y, f" {value:.1f}", va="center", fontsize=8)
    axis.set_xlabel("TPOT, ms per output token (token-weighted; lower is faster)")
    axis.set_title(f"Request by request, one run (commit {record_of(run)['git']['short']})", fontsize=10)
    axis.tick_params(axis="y", labelsize=8)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110, metadata={"Software": None})


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="exit 1 if the committed page is not this output")
    parser.add_argument("--readme", action="store_true", help="print the README's performance table")
    args = parser.parse_args(argv)
    text = render()
    if args.readme:
        print("\n".join(readme_table(run) for run in bundle_runs("lockstep")), end="")
        return 0
    if args.check:
        same = PAGE.is_file() and PAGE.read_text(encoding="utf-8") == text
        print("docs/performance.md is up to date" if same else "docs/performance.md differs: run "
              "python benchmarks/make_perf_page.py", file=sys.stderr)
        return 0 if same else 1
    PAGE.parent.mkdir(parents=True, exist_ok=True)
    PAGE.write_text(text, encoding="utf-8")
    plots = [plot_path(run) for run in bundle_runs("lockstep")]
    for run, path in zip(bundle_runs("lockstep"), plots):
        plot(run, path)
    print(f"wrote {rel(PAGE)} and {', '.join(rel(path) for path in plots)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
