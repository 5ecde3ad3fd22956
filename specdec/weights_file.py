"""The native weights file (native.bin) that export writes and the engine reads: its tensors, each aligned, and its own
table of them; numpy only (the ground floor, beside manifest.py). Each tensor's element is a TensorKind of
specdec.weight_kinds (DTYPES holds its numpy dtype).
"""
from __future__ import annotations

import json
import mmap
import os
import struct
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path

import numpy as np

from specdec.files import open_regular
from specdec.weight_kinds import DTYPES, TensorKind, WeightKind

FORMAT_VERSION = 4  # specdec_native.h's SPECDEC_FORMAT_VERSION: the blocks and the weights file (a bundle's native.abi)
CHANGED_SINCE = {2: frozenset({TensorKind.BLK5}), 3: frozenset()}  # an older format: the kinds whose layout changed
# since (3: blk5's codes; 4: none, the file holds its own table and extent: read_tensors)
MAGIC = b"SPECDEC-NATIVE\x00\x00"  # the weights file's first 16 bytes
ALIGN = 64  # every tensor of the weights file starts at a multiple of this (cache lines, AVX loads)


# The header: MAGIC, u32 format, u32 bytes of the table, u64 offset of the table. From format TABLE_SINCE the file
# holds its own table of tensors after the last one (JSON: name -> {kind, shape, offset}, as the manifest's index):
# it says where it ends (its size) and what each tensor is. Older files leave both words zero.
HEADER = len(MAGIC) + 16
TABLE_SINCE = 4
MAX_TABLE = 1 << 24  # bytes a file's table may take (a model of a thousand layers takes about 1 MiB)


@dataclass(frozen=True)
class TensorEntry:
    """Where one tensor lies in a native weights file."""

    kind: str  # a key of DTYPES
    shape: tuple
    offset: int  # bytes from the file's start, a multiple of ALIGN

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * DTYPES[self.kind].itemsize


def index_from(tensors: dict) -> dict:
    """A manifest's (or a file's) {name: {"kind", "shape", "offset"}} -> {name: TensorEntry}; KeyError, TypeError or
    ValueError where an entry is not of that form."""
    return {name: TensorEntry(spec["kind"], tuple(spec["shape"]), int(spec["offset"]))
            for name, spec in tensors.items()}


def _kind_of(array: np.ndarray) -> TensorKind:
    for kind, dtype in DTYPES.items():
        if array.dtype == dtype:
            return kind
    raise TypeError(f"no native kind for dtype {array.dtype}")


def write_tensors(path: Path, tensors: dict) -> dict:
    """Write `tensors` (name -> array of a DTYPES kind) to `path`, each aligned, then their table; -> {name:
    TensorEntry}."""
    index, offset = {}, HEADER
    with open(path, "wb") as handle:
        handle.write(b"\0" * HEADER)  # the header last, once the table's place is known
        for name, array in tensors.items():
            offset = -(-offset // ALIGN) * ALIGN
            handle.write(b"\0" * (offset - handle.tell()))
            data = np.ascontiguousarray(array)
            index[name] = TensorEntry(_kind_of(data), tuple(int(n) for n in data.shape), offset)
            handle.write(data.tobytes())
            offset += data.nbytes
        table = json.dumps({name: {"kind": entry.kind, "shape": list(entry.shape), "offset": entry.offset}
                            for name, entry in index.items()}).encode()
        handle.write(table)
        handle.seek(0)
        handle.write(MAGIC + struct.pack("<IIQ", FORMAT_VERSION, len(table), offset))
    return index


def check_index(index: dict, size: int, name: str) -> None:
    """ValueError unless every tensor of `index` starts at a multiple of ALIGN past the header and ends inside the
    file's `size` bytes (before its table), and no two overlap (a manifest that passes its hash can still point
    anywhere)."""
    spans = []
    for tensor, entry in index.items():
        if entry.kind not in DTYPES or any(not isinstance(n, int) or n < 0 for n in entry.shape):
            raise ValueError(f"{name}: tensor {tensor} has kind {entry.kind!r} and shape {list(entry.shape)}")
        if entry.offset < HEADER or entry.offset % ALIGN:
            raise ValueError(f"{name}: tensor {tensor} starts at byte {entry.offset}, not a multiple of {ALIGN} past "
                             "the header")
        if entry.offset + entry.nbytes > size:
            raise ValueError(f"{name} has {size} bytes; tensor {tensor} needs {entry.offset + entry.nbytes}")
        spans.append((entry.offset, entry.offset + entry.nbytes, tensor))
    spans.sort()
    for (_, end, first), (start, _, second) in zip(spans, spans[1:]):
        if start < end:
            raise ValueError(f"{name}: tensors {first} and {second} overlap (bytes {start}..{end})")


EXPONENTS = {np.dtype("<f4"): (np.dtype("<u4"), 0x7F800000), np.dtype("<f2"): (np.dtype("<u2"), 0x7C00),
             WeightKind.BF16.dtype: (WeightKind.BF16.dtype, 0x7F80)}  # a value is NaN or inf exactly where its
# exponent bits are all ones
CHUNK = 1 << 20


def nonfinite(array: np.ndarray) -> bool:
    """Whether a native tensor holds NaN or inf where the kernels read a float: f32 / f16 / bf16 values, and the
    scales and minima of blocks (their codes are integers). The largest exponent field, a chunk at a time through one
    buffer (a bf16 model of 135M weights: about 0.05 s)."""
    if array.dtype.names:
        return any(nonfinite(np.ascontiguousarray(array[field])) for field in ("d", "m", "h")
                   if field in array.dtype.names)
    if array.dtype not in EXPONENTS:
        return False
    bits, mask = EXPONENTS[array.dtype]
    flat = np.ascontiguousarray(array).reshape(-1).view(bits)
    out = np.empty(min(CHUNK, flat.size), bits)
    for start in range(0, flat.size, CHUNK):
        part = out[: min(CHUNK, flat.size - start)]
        np.bitwise_and(flat[start : start + CHUNK], mask, out=part)
        if int(part.max()) == mask:
            return True
    return False


class Pages(StrEnum):
    """How read_tensors holds a weights file (see there)."""

    PRIVATE = "private"
    SHARED = "shared"


PAGES = tuple(Pages)
READ_CHUNK = 1 << 24


def check_format(abi: int, kinds: set, name: str) -> None:
    """ValueError unless weights of format `abi` holding tensors of `kinds` read as this format: the same format, or
    an older one none of whose changed layouts (CHANGED_SINCE) they use."""
    if abi == FORMAT_VERSION:
        return
    if abi not in CHANGED_SINCE:
        raise ValueError(f"{name} holds native weights of format {abi}, this specdec reads format {FORMAT_VERSION}")
    changed = sorted(CHANGED_SINCE[abi] & set(kinds))
    if changed:  # the format that changed them: the first later one they are not changed since
        at = min(v for v in range(abi + 1, FORMAT_VERSION + 1) if not CHANGED_SINCE.get(v, frozenset()) & set(changed))
        raise ValueError(f"{name} holds native weights of format {abi} with {', '.join(changed)} blocks, whose layout "
                         f"changed in format {at}")


def _extent(fd: int, name: str) -> tuple[int, int, int]:
    """(format, the table's offset, its bytes; both 0 before format TABLE_SINCE) of an open native weights file.
    ValueError where it has no magic, or its size is not the one its header gives (padded or cut short): two small
    reads and its size, before anything else is read."""
    size, head = os.fstat(fd).st_size, os.pread(fd, HEADER, 0)
    if head[: len(MAGIC)] != MAGIC:
        raise ValueError(f"{name} is not a native weights file (no magic)")
    if len(head) < HEADER:
        raise ValueError(f"{name} has {size} bytes, fewer than its {HEADER}-byte header")
    abi, table_bytes, table_at = struct.unpack("<IIQ", head[len(MAGIC) :])
    if abi < TABLE_SINCE:
        return abi, 0, 0
    if table_at < HEADER or table_bytes > MAX_TABLE or table_at + table_bytes != size:
        raise ValueError(f"{name} has {size} bytes; its header says it ends at byte {table_at + table_bytes} (a "
                         f"table of {table_bytes} bytes at byte {table_at}): the file was padded or cut short")
    return abi, table_at, table_bytes


def check_extent(path: Path) -> None:
    """_extent's checks alone: load(verify=True) runs them before it hashes the file."""
    fd = open_regular(path)
    try:
        _extent(fd, str(path))
    finally:
        os.close(fd)


def _table(fd: int, at: int, size: int, name: str) -> dict:
    """The file's own table of tensors ({name: TensorEntry}), `size` bytes at byte `at`."""
    try:
        return index_from(json.loads(os.pread(fd, size, at).decode("utf-8")))
    except (UnicodeDecodeError, ValueError, RecursionError, KeyError, TypeError, AttributeError):
        raise ValueError(f"{name}: its table of tensors (bytes {at}..{at + size}) cannot be read") from None


def check_table(index: dict, table: dict, name: str) -> None:
    """ValueError unless the manifest's `index` describes every tensor as the file's own `table` does: the same
    names, each of the same kind and shape at the same offset (a manifest edited apart from its file, with offsets
    swapped or a kind misread, points at the wrong bytes however its hash stands)."""
    where = lambda e: "absent" if e is None else f"{e.kind} {list(e.shape)} at byte {e.offset}"  # noqa: E731
    for tensor in sorted(set(index) | set(table)):
        mine, theirs = index.get(tensor), table.get(tensor)
        if mine != theirs:
            raise ValueError(f"{name}: the manifest reads tensor {tensor} as {where(mine)}; the file's own table "
                             f"holds it as {where(theirs)}")


def read_tensors(path: Path, index: dict, pages: str = Pages.SHARED) -> dict:
    """Every tensor of `index` ({name: TensorEntry}) of `path`, read only. ValueError where the file is not a native
    weights file of this format, is padded or cut short, is shorter than the index needs, or holds its own table
    (format TABLE_SINCE on) that the index contradicts; ManifestError where it is not a regular file. Only the bytes
    up to the index's last tensor are mapped or copied.

    pages "shared": the file memory-mapped (the page cache's 4 KiB pages, shared with every process that maps it).
    "private": the file read into anonymous memory advised for transparent huge pages. Streaming a weight then crosses
    a page boundary every 2 MiB instead of every 4 KiB, and the hardware prefetchers stop at each: a bf16 target's
    step runs measurably faster (`python benchmarks/step.py BUNDLE --backends native --pages private,shared`), at
    the cost of a copy per process."""
    if pages not in PAGES:
        raise ValueError(f"pages {pages!r} is not one of {', '.join(PAGES)}")
    fd = open_regular(path)
    try:
        abi, table_at, table_bytes = _extent(fd, str(path))
        check_format(abi, {entry.kind for entry in index.values()}, str(path))
        check_index(index, table_at or os.fstat(fd).st_size, str(path))
        if table_at:
            check_table(index, _table(fd, table_at, table_bytes, str(path)), str(path))
        need = max((entry.offset + entry.nbytes for entry in index.values()), default=HEADER)
        whole = _private_copy(fd, need, path) if pages == Pages.PRIVATE else \
            np.frombuffer(mmap.mmap(fd, need, access=mmap.ACCESS_READ), dtype=np.uint8)  # the map outlives fd
    finally:
        os.close(fd)
    return {name: whole[entry.offset : entry.offset + entry.nbytes].view(DTYPES[entry.kind]).reshape(entry.shape)
            for name, entry in index.items()}


def _private_copy(fd: int, size: int, path: Path) -> np.ndarray:
    """The first `size` bytes of the open file `fd` read into anonymous memory (page aligned, advised for huge pages
    where the kernel offers them), as a read-only byte array that keeps the mapping alive. Read with readinto, so the
    file's pages are never mapped here and the process's peak memory is the copy alone."""
    buffer = mmap.mmap(-1, max(size, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            buffer.madvise(mmap.MADV_HUGEPAGE)
        except OSError:  # a kernel without transparent huge pages: 4 KiB pages, still correct
            pass
    with memoryview(buffer) as view, open(fd, "rb", buffering=0, closefd=False) as handle:
        handle.seek(0)
        done = 0
        while done < size:
            got = handle.readinto(view[done : min(size, done + READ_CHUNK)])
            if not got:
                raise ValueError(f"{path} ended after {done} of its {size} bytes")
            done += got
    whole = np.frombuffer(buffer, dtype=np.uint8)[:size]
    whole.flags.writeable = False
    return whole
