"""A bundle's files, opened only where they are regular files (stdlib only; the ground floor, beside manifest.py).

A FIFO in place of a bundle file blocks its reader forever (with --no-verify nothing reads it first), and a device
may never end. So every file the runtime reads is checked before it is read: stat refuses anything that is not a
regular file without opening it (opening a device can act on it); the open itself is non-blocking (a FIFO swapped in
after the stat opens at once) and fstat checks the object that was opened, so no swap between the check and the read
goes unseen. A library that opens a path itself (onnxruntime) gets it after `check_regular`: the gap left is between
that check and the library's own open.
"""
from __future__ import annotations

import os
import stat
from pathlib import Path

from specdec.errors import ManifestError

HINT = "a bundle holds regular files only: put back the file specdec-export wrote (re-export, or copy the bundle again)"
FLAGS = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOCTTY", 0) | getattr(os, "O_CLOEXEC", 0)


def what_is(mode: int) -> str:
    """The kind of file `mode` (st_mode) describes, in words."""
    for test, name in ((stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISDIR, "a directory"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return name
    return "not a regular file"


def _refuse(path: Path, mode: int) -> ManifestError:
    return ManifestError(f"bundle file {str(path)!r} is {what_is(mode)}, not a regular file", HINT)


def open_regular(path: str | os.PathLike) -> int:
    """A read-only, blocking descriptor of `path`, which must be a regular file (links followed); ManifestError
    where it is something else or cannot be opened, FileNotFoundError where it does not exist. The caller closes
    it."""
    path = Path(path)
    try:
        mode = os.stat(path).st_mode
        if not stat.S_ISREG(mode):
            raise _refuse(path, mode)
        fd = os.open(path, FLAGS)
    except FileNotFoundError:
        raise
    except OSError as exc:  # a folder on the way it may not enter, a file it may not read
        raise ManifestError(f"bundle file {str(path)!r} cannot be opened: {exc.strerror}",
                            "the user running specdec must be able to read the bundle's files and enter its "
                            "folders") from None
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):  # replaced between the stat and the open
            raise _refuse(path, mode)
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def check_regular(path: str | os.PathLike) -> None:
    """ManifestError unless `path` is a regular file (opened and checked, then closed: for a path that a library
    opens itself)."""
    os.close(open_regular(path))


def read_regular(path: str | os.PathLike) -> bytes:
    """The bytes of `path`, a regular file (open_regular's errors)."""
    with os.fdopen(open_regular(path), "rb") as handle:
        return handle.read()
