"""Compile kernels.c on first use (cc or gcc, -O3 -mavx2 -mfma -mf16c -fopenmp) into a per-user cache, and load it."""
from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from specdec.errors import BackendError

SOURCE = Path(__file__).with_name("kernels.c")
FLAGS = ("-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp", "-shared", "-fPIC")
LIBRARIES = ("-lm",)
REQUIRED_FLAGS = ("avx2", "fma", "f16c")  # /proc/cpuinfo names of what FLAGS let the compiler use
NO_NATIVE = "use backend='onnxruntime'"


def cache_dir() -> Path:
    """$SPECDEC_CACHE, else $XDG_CACHE_HOME/specdec, else ~/.cache/specdec."""
    if os.environ.get("SPECDEC_CACHE"):
        return Path(os.environ["SPECDEC_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "specdec"


def missing_cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> list:
    """The flags of REQUIRED_FLAGS this CPU lacks (all of them where /proc/cpuinfo cannot be read)."""
    try:
        words = set(cpuinfo.read_text(encoding="utf-8", errors="replace").split())
    except OSError:
        return list(REQUIRED_FLAGS)
    return [flag for flag in REQUIRED_FLAGS if flag not in words]


def compiler() -> str:
    """$CC, else cc, else gcc; BackendError where none is found."""
    for name in (os.environ.get("CC"), "cc", "gcc"):
        if name and shutil.which(name):
            return shutil.which(name)
    raise BackendError("the native backend compiles its kernels on first use and found no C compiler "
                       f"(CC={os.environ.get('CC')!r}, cc, gcc)", f"install gcc (apt install gcc), or {NO_NATIVE}")


def _compile(cc: str, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as scratch:  # then one rename: no half-written library
        built = Path(scratch) / target.name
        done = subprocess.run([cc, *FLAGS, str(SOURCE), "-o", str(built), *LIBRARIES], capture_output=True, text=True)
        if done.returncode != 0:
            last = (done.stderr.strip().splitlines() or ["no message"])[-1]
            raise BackendError(f"compiling {SOURCE.name} with {cc} failed: {last}",
                               f"the kernels need a compiler with AVX2, FMA, F16C and OpenMP (gcc does), or {NO_NATIVE}")
        os.replace(built, target)


@functools.cache
def load_kernels() -> ctypes.CDLL:
    """The compiled kernels (built once per source, flags and compiler; cached across processes)."""
    lacking = missing_cpu_flags()
    if lacking:
        raise BackendError(f"the native backend needs an x86-64 CPU with {' and '.join(REQUIRED_FLAGS)}; this one "
                           f"lacks {', '.join(lacking)}", NO_NATIVE)
    cc = compiler()
    key = hashlib.sha256(SOURCE.read_bytes() + " ".join((cc, *FLAGS, *LIBRARIES)).encode()).hexdigest()[:16]
    library = cache_dir() / "native" / key / "libspecdec_kernels.so"
    if not library.is_file():
        _compile(cc, library)
    lib = ctypes.CDLL(str(library))
    pointer, integer = ctypes.c_void_p, ctypes.c_int
    for name in ("q41_gemm", "q8_gemm"):
        getattr(lib, name).argtypes = [pointer, integer, integer, pointer, pointer, integer]
        getattr(lib, name).restype = None
    for name in ("int8_gemm", "prefill_products"):
        getattr(lib, name).argtypes = [pointer, integer, integer, pointer, integer, pointer, integer]
        getattr(lib, name).restype = integer
    lib.specdec_set_threads.argtypes, lib.specdec_set_threads.restype = [integer], None
    lib.specdec_forward.argtypes = [pointer, pointer, integer, integer, pointer, pointer, ctypes.c_long, integer,
                                    integer, integer, pointer]
    lib.specdec_forward.restype = integer
    lib.specdec_attention.argtypes = [pointer, integer, integer, integer, integer, pointer, pointer, integer, integer,
                                      ctypes.c_float, pointer]
    lib.specdec_attention.restype = integer
    return lib
