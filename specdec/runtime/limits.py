"""What this machine lets an operator ask for, and the one check of an option against it: counts bounded by the cores
this process may use (specdec.runtime.backend.cpu_count) or by the memory it may use (memory_bytes), durations by
MAX_TIMEOUT_S. A refusal names the option, the value seen and the limit, with a hint (ConfigError)."""
from __future__ import annotations

import math
import numbers
import os
from pathlib import Path

from specdec.errors import ConfigError, shown
from specdec.runtime.backend import cpu_count

__all__ = ["MAX_TIMEOUT_S", "PER_CORE", "bounded_int", "bounded_seconds", "cpu_count", "memory_bytes", "open_files_max"]

PER_CORE = 4  # processes or threads per core: more only oversubscribes the cores
MAX_TIMEOUT_S = 3600.0  # the longest wait an option may set (a prompt's rendering, an idle connection)
UNKNOWN_MEMORY = 1 << 62  # where neither /proc/meminfo nor sysconf answers: no bound from memory


def memory_bytes(meminfo: Path = Path("/proc/meminfo"), proc: Path = Path("/proc/self/cgroup"),
                 fs: Path = Path("/sys/fs/cgroup")) -> int:
    """The memory this process may use: the machine's (MemTotal), capped by the memory limit of its cgroup and of every
    cgroup above it (v2 memory.max, v1 memory.limit_in_bytes: a container limited to 4 GB on a 64 GB host)."""
    total = _mem_total(meminfo)
    for level, name in _cgroup_folders(proc, fs):
        try:
            total = min(total, int((level / name).read_text(encoding="utf-8")))
        except (OSError, ValueError):  # no such file, or "max": no limit at this level
            pass
    return total


def _cgroup_folders(proc: Path, fs: Path) -> list:
    """(folder, limit file) of this process's memory cgroup and each one above it."""
    try:
        lines = proc.read_text(encoding="utf-8").splitlines()
    except OSError:
        return []
    found = []
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        if line.startswith("0::"):
            root, name = fs, "memory.max"
        elif "memory" in parts[1].split(","):
            root, name = fs / "memory", "memory.limit_in_bytes"
        else:
            continue
        folder = root / parts[2].strip().lstrip("/")
        found += [(level, name) for level in [folder, *folder.parents] if level == root or root in level.parents]
    return found


def _mem_total(meminfo: Path) -> int:
    try:
        line = next(line for line in meminfo.read_text(encoding="utf-8").splitlines() if line.startswith("MemTotal:"))
        return int(line.split()[1]) << 10  # "MemTotal:  24536516 kB"
    except (OSError, ValueError, IndexError, StopIteration):
        pass
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return UNKNOWN_MEMORY


def open_files_max(nr_open: Path = Path("/proc/sys/fs/nr_open")) -> int:
    """The most files a process may have open on this machine (the kernel's fs.nr_open, else this process's hard
    RLIMIT_NOFILE): no server holds more connections."""
    try:
        return int(nr_open.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        pass
    try:
        import resource

        hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
        return 1 << 20 if hard == resource.RLIM_INFINITY else hard
    except (ImportError, OSError, ValueError):
        return 1 << 20


def bounded_int(name: str, value, low: int, high: int, why: str, hint: str) -> int:
    """`value` as a Python int in low..high (`why` says where `high` comes from); numpy integers are integers, bools
    are not."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or not low <= value <= high:
        raise ConfigError(f"{name} must be an integer in {low}..{high} ({why}), got {shown(value)}", hint)
    return int(value)


def bounded_seconds(name: str, value, high: float, hint: str) -> float:
    """`value` as a float of seconds in (0, high]."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value) \
            or not 0 < value <= high:
        raise ConfigError(f"{name} must be a number of seconds in (0, {high:g}], got {shown(value)}", hint)
    return float(value)
