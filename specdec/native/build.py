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


def _compile(cc: str, source: Path, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as scratch:  # then one rename: no half-written library
        built = Path(scratch) / target.name
        done = subprocess.run([cc, *FLAGS, str(source), "-o", str(built), *LIBRARIES], capture_output=True, text=True)
        if done.returncode != 0:
            last = (done.stderr.strip().splitlines() or ["no message"])[-1]
            raise BackendError(f"compiling {source.name} with {cc} failed: {last}",
                               f"the kernels need a compiler with AVX2, FMA, F16C and OpenMP (gcc does), or {NO_NATIVE}")
        os.replace(built, target)


_P, _I = ctypes.c_void_p, ctypes.c_int
SIGNATURES = {  # the kernels' exports: argument types, result type
    "q41_gemm": ([_P, _I, _I, _P, _P, _I], None),
    "q8_gemm": ([_P, _I, _I, _P, _P, _I], None),
    "int8_gemm": ([_P, _I, _I, _P, _I, _P, _I], _I),
    "prefill_products": ([_P, _I, _I, _P, _I, _P, _I], _I),
    "specdec_set_threads": ([_I], None),
    "specdec_forward": ([_P, _P, _I, _I, _P, _P, ctypes.c_long, _I, _I, _I, _P], _I),
    "specdec_attention": ([_P, _I, _I, _I, _I, _P, _P, _I, _I, ctypes.c_float, _P], _I),
}


def compiled(source: Path) -> Path:
    """The shared library of `source` (compiled once per source text, flags and compiler; cached across processes)."""
    lacking = missing_cpu_flags()
    if lacking:
        raise BackendError(f"the native backend needs an x86-64 CPU with {' and '.join(REQUIRED_FLAGS)}; this one "
                           f"lacks {', '.join(lacking)}", NO_NATIVE)
    cc = compiler()
    key = hashlib.sha256(source.read_bytes() + " ".join((cc, *FLAGS, *LIBRARIES)).encode()).hexdigest()[:16]
    library = cache_dir() / "native" / key / "libspecdec_kernels.so"
    if not library.is_file():
        _compile(cc, source, library)
    return library


def declare(lib: ctypes.CDLL, names=tuple(SIGNATURES)) -> ctypes.CDLL:
    """Give the exports `names` of a loaded library their SIGNATURES."""
    for name in names:
        function = getattr(lib, name)
        function.argtypes, function.restype = SIGNATURES[name]
    return lib


@functools.cache
def load_kernels() -> ctypes.CDLL:
    """The compiled kernels.c, its exports declared."""
    return declare(ctypes.CDLL(str(compiled(SOURCE))))
