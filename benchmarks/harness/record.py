"""The run record: what a result needs to be read and re-run later, written beside it as record.json.

A record holds the git commit and whether the tree was dirty, the CPU (model, the flags the kernels care about),
cores and threads, package versions, each system's settings (a peer's as its docs tell users to tune it), and the
command line. Results go under benchmarks/results/<experiment>/<date>-<commit>/ unless --out names a folder.
"""
from __future__ import annotations

import datetime
import json
import os
import platform
import subprocess
import sys
from importlib import metadata
from pathlib import Path

from . import tables

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"
RECORD = "record.json"
SCHEMA = 1
CPU_FLAGS = ("sse4_2", "avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512_vnni", "avx512vbmi",
             "avx512_bf16", "avx_vnni", "amx_tile", "amx_bf16", "amx_int8", "asimd", "sve")
PACKAGES = ("specdec", "numpy", "onnxruntime", "onnx", "tokenizers", "torch", "transformers", "polars", "fastapi",
            "uvicorn", "ray")


def _git(*args: str) -> str:
    done = subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True, check=False)
    return done.stdout.strip() if done.returncode == 0 else ""


def git_state() -> dict:
    """{"commit", "short", "dirty"}: dirty when code (anything outside benchmarks/results) differs from the commit."""
    commit = _git("rev-parse", "HEAD")
    changes = _git("status", "--porcelain", "--", ".", ":(exclude)benchmarks/results")
    return {"commit": commit or None, "short": commit[:7] or "nogit", "dirty": bool(changes) if commit else None}


def cpu_info() -> dict:
    """CPU model, the SIMD flags present, logical CPUs, the CPUs this process may use, and the cgroup CPU quota."""
    model, flags = platform.processor() or platform.machine(), set()
    try:
        text = Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace")
    except OSError:
        text = ""
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "model name":
            model = value.strip()
        elif key in ("flags", "Features"):
            flags.update(value.split())
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {"model": model, "flags": [f for f in CPU_FLAGS if f in flags], "logical_cpus": os.cpu_count(),
            "usable_cpus": usable, "cgroup_quota_cpus": cgroup_quota()}


def cgroup_quota() -> float | None:
    """CPUs allowed by a cgroup v2 quota (cpu.max), or None without one."""
    try:
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()[:2]
    except (OSError, ValueError):
        return None
    return None if quota == "max" else round(int(quota) / int(period), 2)


def package_versions(names: tuple = PACKAGES) -> dict:
    versions = {}
    for name in names:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return versions


def repo_path(path: str | Path) -> str:
    """`path` as a record writes it: relative to the repository root where it lies inside, else its name alone (a
    record never holds the absolute paths of the machine that made it). Symbolic links are kept as named (a bundles/
    folder linked elsewhere stays bundles/...)."""
    path = Path(os.path.abspath(path))
    try:
        return str(path.relative_to(ROOT))
    except ValueError:
        return path.name


def command_line(script: str, args: list | None = None) -> str:
    """The command as a user would type it from the repository root: `python benchmarks/X.py ARGS`, an absolute path
    among ARGS written as repo_path writes it."""
    args = sys.argv[1:] if args is None else list(args)
    return " ".join(["python", repo_path(script), *(repo_path(a) if os.path.isabs(str(a)) else str(a) for a in args)])


def run_record(experiment: str, settings: dict, threads: int | None, script: str, args: list | None = None,
               **extra) -> dict:
    """A new record. settings: {system: {setting: value}} for every system the run measured (ours and peers');
    script and args: the entry point's __file__ and its arguments (None: sys.argv's)."""
    now = datetime.datetime.now(datetime.timezone.utc)
    return {"schema": SCHEMA, "experiment": experiment, "date": now.date().isoformat(),
            "started": now.isoformat(timespec="seconds"), "git": git_state(), "command": command_line(script, args),
            "machine": {"cpu": cpu_info(), "os": f"{platform.system()} {platform.release()}",
                        "python": platform.python_version(), "threads": threads},
            "packages": package_versions(), "settings": settings, **extra}


def run_dir(experiment: str, record: dict, out: str | Path | None = None, results: Path | None = None) -> Path:
    """`out` when given, else <results>/<experiment>/<date>-<commit>[-dirty][-N]/ (results: benchmarks/results); created.
    A default folder that already holds a run (another bundle's, say, at the same commit) gets the next free -N: no
    run overwrites another."""
    if out is None:
        git = record["git"]
        name = f"{record['date']}-{git['short']}" + ("-dirty" if git["dirty"] else "")
        out = (results or RESULTS) / experiment / name
        taken, n = Path(out), 1
        while (taken / RECORD).exists():
            n += 1
            taken = Path(f"{out}-{n}")
        out = taken
    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def write_record(folder: Path, record: dict, **finished) -> Path:
    """record.json in `folder`, with `finished` (the end time and any results worth a number) added."""
    stamp = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    data = dict(record, finished=stamp, **finished)
    path = Path(folder) / RECORD
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    return path


def finish(run: dict, out: str | Path | None, files: dict, shown: str | None = None, **finished) -> Path:
    """The end of every entry point: the run's folder (`out`, else run_dir's default), each of `files` written into it
    ({name: a table's markdown text, or a CSV's rows as dicts}), record.json with `finished` added (write_record),
    then `shown` printed (what the terminal gets: the tables, say) and the folder. -> the folder."""
    folder = run_dir(run["experiment"], run, out)
    for name, content in files.items():
        if isinstance(content, str):
            tables.write_text(folder / name, content)
        else:
            tables.write_csv(folder / name, content)
    write_record(folder, run, **finished)
    if shown is not None:
        print(shown)
    print(f"written: {folder}")
    return folder


def read_record(folder: Path) -> dict:
    return json.loads((Path(folder) / RECORD).read_text(encoding="utf-8"))
