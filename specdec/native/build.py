"""Compile the native engine's C sources on first use and load the library, checked.

The sources ship inside the package (package data), so an installed wheel compiles them like a checkout does: a
prebuilt library would need one wheel per CPU and libc, while the kernels are built for the machine that runs them
(-mavx2 -mfma -mf16c, checked against /proc/cpuinfo; AVX-512 and VNNI too where the CPU has them, see isa()). The
library is cached per user, keyed by the sources, flags and compiler, and used only if:
- the cache directory and the library belong to this user and no one else may write them (else a private
  temporary directory is built into instead);
- it loads, has every export, and reports this specdec's ABI version, sizes and table of weight kinds (else it is
  rebuilt).
A file lock makes processes that start together compile once.
"""
from __future__ import annotations

import atexit
import contextlib
import ctypes
import fcntl
import functools
import hashlib
import logging
import os
import shutil
import stat
import subprocess
import tempfile
from pathlib import Path

from specdec.errors import BackendError
from specdec.weight_kinds import Isa, WeightKind

log = logging.getLogger(__name__)
HERE = Path(__file__).parent
SOURCES = tuple(HERE / name for name in (
    "forward.c", "head.c", "linear.c", "linear_q8a.c", "linear_bf16a.c", "attention.c", "pool.c"))
HEADERS = tuple(HERE / name for name in ("specdec_native.h", "specdec_kinds.h", "internal.h", "pool.h"))
ABI_VERSION = 11  # specdec_native.h's SPECDEC_ABI_VERSION: the exports (SIGNATURES), model_t and status codes
FLAGS = ("-O3", "-mavx2", "-mfma", "-mf16c", "-pthread", "-shared", "-fPIC", "-Wall", "-Wextra", "-Werror")
SANITIZE_FLAGS = ("-O1", "-g", "-fno-omit-frame-pointer", "-fsanitize=address,undefined", "-fno-sanitize-recover=all")
SANITIZE_ENV = "SPECDEC_NATIVE_SANITIZE"  # "1": build with ASan + UBSan (the CI's sanitizer run; needs LD_PRELOAD)
LIBRARIES = ("-lm",)
REQUIRED_FLAGS = ("avx2", "fma", "f16c")  # /proc/cpuinfo names of what FLAGS let the compiler use
# Wider kernels where the CPU has them: 16-lane products, 32 registers, VNNI's int8 dot products (same results)
AVX512_FLAGS = ("-mavx512f", "-mavx512vl", "-mavx512bw", "-mavx512dq", "-mavx512vnni")
AVX512_CPU = ("avx512f", "avx512vl", "avx512bw", "avx512dq", "avx512_vnni")
# ... and VBMI's multishift, which unpacks a blk5 block's 5-bit codes in one instruction a half (same results)
VBMI_FLAGS = AVX512_FLAGS + ("-mavx512vbmi",)
VBMI_CPU = AVX512_CPU + ("avx512vbmi",)
ISA_ENV = "SPECDEC_NATIVE_ISA"  # an Isa (specdec.weight_kinds: the builds the table of weight kinds names)
ISAS = tuple(Isa)
# ... and, on a CPU without AVX-512, AVX-VNNI's 256-bit int8 dot products (the int8 activations' kernel; same results)
AVX2_VNNI_FLAGS = ("-mavxvnni",)
AVX2_VNNI_CPU = ("avx_vnni",)
ISA_FLAGS = {Isa.AVX2: (), Isa.AVX512: AVX512_FLAGS, Isa.AVX512_VBMI: VBMI_FLAGS,
             Isa.AVX2_VNNI: AVX2_VNNI_FLAGS}  # beyond FLAGS
ISA_CPU = {Isa.AVX512: AVX512_CPU, Isa.AVX512_VBMI: VBMI_CPU,
           Isa.AVX2_VNNI: AVX2_VNNI_CPU}  # what each wider set needs beyond REQUIRED_FLAGS
WIDEST_FIRST = (Isa.AVX512_VBMI, Isa.AVX512, Isa.AVX2_VNNI)  # what auto tries, in turn, before avx2
NO_NATIVE = "use backend='onnxruntime'"
LIBRARY_NAME = "libspecdec_native.so"

_P, _I, _L, _S, _F = ctypes.c_void_p, ctypes.c_int, ctypes.c_long, ctypes.c_size_t, ctypes.c_float
SIGNATURES = {  # the exports of specdec_native.h: argument types, result type
    "specdec_abi_version": ([], _I),
    "specdec_layout_size": ([_I], _L),
    "specdec_weight_kind": ([_I, _P], _I),
    "specdec_scratch_bytes": ([_P, _I, _I, _I, _I], _L),
    "specdec_forward": ([_P, _P, _S, _P, _I, _I, _P, _P, _P, _L, _I, _I, _I, _I, _P, _P], _I),
    "specdec_head_scratch_bytes": ([_P, _I, _I, _I, _I], _L),
    "specdec_head_forward": ([_P, _P, _S, _P, _P, _I, _I, _P, _P, _P, _I, _I, _I, _I, _P, _P], _I),
    "specdec_matmul_scratch_bytes": ([_I, _I, _I, _I], _L),
    "specdec_matmul": ([_P, _I, _I, _P, _I, _I, _I, _P, _I, _P, _S, _I], _I),
    "specdec_attention_scratch_bytes": ([_I, _I, _I, _I, _I, _I], _L),
    "specdec_attention": ([_P, _I, _I, _I, _I, _P, _P, _I, _I, _F, _P, _P, _S, _I], _I),
}
# the activation blocks' sizes, checked at load (specdec_layout_size's 0: blkq, 1: blkqp; 2: model_t and 3: features_t
# are checked by tests/native/test_c_safety.py); the weight kinds' are their table's, checked whole (_check_kinds)
LAYOUT_SIZES = {0: 72, 1: 144}


def cache_dir() -> Path:
    """$SPECDEC_CACHE, else $XDG_CACHE_HOME/specdec, else ~/.cache/specdec."""
    if os.environ.get("SPECDEC_CACHE"):
        return Path(os.environ["SPECDEC_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "specdec"


def missing_cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo"), required: tuple = REQUIRED_FLAGS) -> list:
    """The flags of `required` this CPU lacks (all of them where /proc/cpuinfo cannot be read)."""
    try:
        words = set(cpuinfo.read_text(encoding="utf-8", errors="replace").split())
    except OSError:
        return list(required)
    return [flag for flag in required if flag not in words]


def isa(cpuinfo: Path = Path("/proc/cpuinfo"), wanted: "Isa | str | None" = None) -> Isa:
    """The instruction set the kernels are built for: `wanted` (load(isa=...)), else $SPECDEC_NATIVE_ISA, where auto
    (or neither) means avx512-vbmi on a CPU with every one of VBMI_CPU, else avx512 on one with every one of
    AVX512_CPU, else avx2-vnni on one with AVX-VNNI, else avx2. All compute the same bits (tests/native/test_isa.py)."""
    source = "isa" if wanted is not None else ISA_ENV
    text = str(wanted) if wanted is not None else os.environ.get(ISA_ENV, "")
    try:
        chosen = Isa(text.strip().lower() or Isa.AUTO)
    except ValueError:
        raise BackendError(f"{source}={text!r} is not one of {', '.join(ISAS)}",
                           f"leave it unset (auto picks the widest this CPU runs), or {NO_NATIVE}") from None
    if chosen is not Isa.AUTO:
        lacking = missing_cpu_flags(cpuinfo, ISA_CPU.get(chosen, ()))
        if lacking:
            raise BackendError(f"{source}={chosen}, but this CPU lacks {', '.join(lacking)}",
                               f"leave {source} unset (auto picks the widest this CPU runs) or choose avx2")
        return chosen
    for widest in WIDEST_FIRST:
        if not missing_cpu_flags(cpuinfo, ISA_CPU[widest]):
            return widest
    return Isa.AVX2


def compiler() -> str:
    """$CC, else cc, else gcc; BackendError where none is found."""
    for name in (os.environ.get("CC"), "cc", "gcc"):
        if name and shutil.which(name):
            return shutil.which(name)
    raise BackendError("the native backend compiles its kernels on first use and found no C compiler "
                       f"(CC={os.environ.get('CC')!r}, cc, gcc)", f"install gcc (apt install gcc), or {NO_NATIVE}")


def build_flags(chosen: Isa | None = None) -> tuple:
    """The compiler's flags for the instruction set `chosen` (None: isa()'s)."""
    flags = FLAGS + ISA_FLAGS[chosen or isa()]
    return flags + SANITIZE_FLAGS if os.environ.get(SANITIZE_ENV) == "1" else flags


def _compile(cc: str, target: Path, chosen: Isa | None = None) -> None:
    with tempfile.TemporaryDirectory(dir=target.parent) as scratch:  # then one rename: no half-written library
        built = Path(scratch) / target.name
        done = subprocess.run([cc, *build_flags(chosen), *map(str, SOURCES), "-o", str(built), *LIBRARIES],
                              capture_output=True, text=True)
        if done.returncode != 0:
            last = (done.stderr.strip().splitlines() or ["no message"])[-1]
            raise BackendError(f"compiling the native kernels with {cc} failed: {last}",
                               f"the kernels need a C compiler with AVX2, FMA and F16C (gcc does), or {NO_NATIVE}")
        os.replace(built, target)


def _private(path: Path) -> bool:
    """Whether `path` belongs to this user and no one else may write it (nor replace it: its directory too)."""
    try:
        info = path.stat()
    except OSError:
        return False
    return info.st_uid == os.getuid() and not info.st_mode & (stat.S_IWGRP | stat.S_IWOTH)


def _usable_dir(folder: Path) -> bool:
    """Create `folder` (0700) where missing; whether it and its parent are private to this user."""
    try:
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError:
        return False
    return folder.is_dir() and _private(folder) and _private(folder.parent) and os.access(folder, os.W_OK)


@functools.cache
def _private_tmp() -> Path:
    """A directory only this process uses, for a cache that is not private or not writable; removed at exit (a
    library already mapped stays usable)."""
    folder = Path(tempfile.mkdtemp(prefix="specdec-native-"))
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    return folder


def library_dir(key: str) -> Path:
    """Where the library of `key` is cached: the user's cache, or a private temporary directory (logged once)."""
    root = cache_dir() / "native"
    folder = root / key
    if _usable_dir(root) and _usable_dir(folder):
        return folder
    log.warning("the native kernels' cache %s is not a directory only this user can write; building in %s",
                folder, _private_tmp())
    return _private_tmp()


@contextlib.contextmanager
def _locked(folder: Path):
    """An exclusive lock on folder/.lock: processes that start cold together compile once."""
    with open(folder / ".lock", "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def source_key(cc: str, chosen: Isa | None = None) -> str:
    digest = hashlib.sha256(" ".join((cc, *build_flags(chosen), *LIBRARIES)).encode())
    for path in SOURCES + HEADERS:
        try:
            digest.update(path.read_bytes())
        except OSError as exc:
            raise BackendError(f"the native kernels' source {path} cannot be read ({exc.strerror})",
                               f"reinstall specdec (its wheel carries the C sources), or {NO_NATIVE}") from exc
    return digest.hexdigest()[:16]


def checked(path: Path) -> ctypes.CDLL:
    """Load `path` and check it: every export, this ABI version, every block size. BackendError otherwise.
    It is loaded from a private copy under a new name, removed once mapped: dlopen hands back an object already
    loaded under the same name, so a library rebuilt in this process (or a mutant a test builds) must not share
    one, and the file checked is the file mapped."""
    fd, copy = tempfile.mkstemp(suffix=".so", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as out, open(path, "rb") as source:
            shutil.copyfileobj(source, out)
        lib = ctypes.CDLL(copy)
        declare(lib)
    except (OSError, AttributeError) as exc:
        why = str(exc).replace(copy, str(path))
        raise BackendError(f"{path} is not a usable native kernels library ({why})", "it is rebuilt") from exc
    finally:
        os.unlink(copy)
    if lib.specdec_abi_version() != ABI_VERSION:
        raise BackendError(f"{path} has ABI {lib.specdec_abi_version()}, this specdec needs {ABI_VERSION}",
                           "it is rebuilt")
    for which, size in LAYOUT_SIZES.items():
        if lib.specdec_layout_size(which) != size:
            raise BackendError(f"{path} lays out block {which} in {lib.specdec_layout_size(which)} bytes, not {size}",
                               "it is rebuilt")
    _check_kinds(lib, path)
    return lib


def library_kinds(lib: ctypes.CDLL) -> tuple[list, int]:
    """([(bytes, per, kernel bits, isa bits) of each id the library answers for, from 0 up to one past this
    specdec's last], the build it is: an ISA bit)."""
    traits, found, build = (ctypes.c_int32 * 5)(), [], 0
    for kind in range(len(WeightKind) + 1):
        if lib.specdec_weight_kind(kind, traits) != 0:
            break
        found.append(tuple(traits[:4]))
        build = traits[4]
    return found, build


def _check_kinds(lib: ctypes.CDLL, path: Path) -> None:
    """BackendError unless the library was built from the table this specdec read (specdec.weight_kinds), for any
    instruction set (a benchmark's or a test's build may differ from build_flags()'s: tests check the cached one's)."""
    found, _ = library_kinds(lib)
    wanted = [kind.traits() for kind in WeightKind]
    if found != wanted:
        raise BackendError(f"{path} has the weight kinds {found}, this specdec's table {wanted}", "it is rebuilt")


def declare(lib: ctypes.CDLL) -> ctypes.CDLL:
    """Give the library's exports their SIGNATURES (AttributeError for a missing one)."""
    for name, (args, result) in SIGNATURES.items():
        function = getattr(lib, name)
        function.argtypes, function.restype = args, result
    return lib


def _check_machine() -> str:
    lacking = missing_cpu_flags()
    if lacking:
        raise BackendError(f"the native backend needs an x86-64 CPU with {' and '.join(REQUIRED_FLAGS)}; this one "
                           f"lacks {', '.join(lacking)}", NO_NATIVE)
    return compiler()


def compiled(chosen: Isa | None = None) -> ctypes.CDLL:
    """The loaded, checked library of this specdec's sources for the instruction set `chosen` (None: isa()'s): built
    once per sources, flags and compiler, rebuilt where the cached one is corrupt, foreign or of another ABI."""
    cc = _check_machine()
    folder = library_dir(source_key(cc, chosen))
    library = folder / LIBRARY_NAME
    with _locked(folder):
        if library.is_file() and _private(library):
            try:
                return checked(library)
            except BackendError as exc:
                log.warning("rebuilding the native kernels: %s", exc.message)
        library.unlink(missing_ok=True)
        _compile(cc, library, chosen)
        return checked(library)  # a library that fails its checks right after the build is not rebuilt again


def load_kernels(wanted: "Isa | str | None" = None) -> ctypes.CDLL:
    """The compiled, checked kernels for the instruction set `wanted` (None: $SPECDEC_NATIVE_ISA, else auto); loaded
    once per process and instruction set. A CPU without AVX2 or a missing compiler is reported before the choice."""
    _check_machine()
    return _loaded(isa(wanted=wanted))


@functools.cache
def _loaded(chosen: Isa) -> ctypes.CDLL:
    return compiled(chosen)


def kernel_runs(lib: ctypes.CDLL, kernel, kind: WeightKind) -> bool:
    """Whether `lib`'s specdec_matmul runs `kernel` (a weight_kinds.Kernel) on weights of `kind` here: the table may
    give a kind a kernel that this build lacks or this CPU cannot run (bf16 activations' AMX tiles). One product of a
    row of zeros answers it."""
    from specdec.weight_kinds import KERNELS

    K = 32
    x = (ctypes.c_float * K)()
    w = (ctypes.c_uint8 * (kind.bytes * kind.elements(K)))()
    y = ctypes.c_float()
    need = lib.specdec_matmul_scratch_bytes(1, K, KERNELS[kernel], 1)
    if need < 0:
        return False
    scratch = (ctypes.c_uint8 * max(need, 64))()
    return lib.specdec_matmul(x, 1, K, w, kind.elements(K), int(kind), KERNELS[kernel], ctypes.byref(y), 1, scratch,
                              len(scratch), 1) == 0


def forget_kernels() -> None:
    """Let the next load_kernels load (and where need be build) again: a test's or benchmark's own cache."""
    _loaded.cache_clear()
