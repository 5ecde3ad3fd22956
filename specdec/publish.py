"""Atomic publication of bundles and files, and the rules that keep `--overwrite` from losing data (stdlib only).

A bundle is built in a hidden staging directory beside its destination, `.<name>.<pid>-<random>.partial`, and
renamed into place only when complete, so readers never see half a bundle. The owning PID in the name lets a
later run remove the partials of processes that died (kill -9, power loss) without touching a live export's.
`--overwrite` replaces only a specdec bundle (a directory whose manifest.json parses as a specdec manifest of this
schema version, with every file it lists present), never `.`, `/`, the home directory, a model source, or a
directory that contains one; the rule is checked again just before the old bundle is moved aside.
"""
from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
import tempfile
import threading
from pathlib import Path
from typing import Iterator

from specdec.errors import ConfigError, Terminated

log = logging.getLogger(__name__)

MANIFEST_NAME = "manifest.json"
_MANIFEST_LIMIT = 64 << 20  # bytes; a manifest is a few kB, even with many engines
_STOPPING = threading.Event()  # set by a SIGTERM handler: nothing is published after it, even if a library swallowed
# the Terminated exception it raised (third-party code may catch BaseException around a long native call)
_LEFTOVER = re.compile(r"^\.(?P<name>.+)\.(?P<pid>\d+)-[^.]+\.(partial|old)$")


def _inside(path: Path, parent: Path) -> bool:
    return path == parent or parent in path.parents


def check_destination(out: str | os.PathLike, overwrite: bool, sources=(), flag: str = "--out") -> Path:
    """Refuse a destination that would lose data, before any work starts. `sources`: paths the job reads."""
    out = Path(out)
    resolved = out.expanduser().resolve()
    for special, what in ((Path("/"), "the root directory"), (Path.cwd().resolve(), "the current directory"),
                          (Path.home().resolve(), "the home directory")):
        if resolved == special:
            raise ConfigError(f"{flag} {str(out)!r} is {what}", f"pass a new directory for the bundle, e.g. {flag} bundles/b")
    for source in sources:
        src = Path(source).expanduser().resolve()
        if _inside(resolved, src) or _inside(src, resolved):
            relation = "is" if resolved == src else ("is inside" if _inside(resolved, src) else "contains")
            raise ConfigError(f"{flag} {str(out)!r} {relation} the source {str(source)!r}",
                              f"write the bundle somewhere else: {flag} must not overlap what is read")
    if not resolved.exists() and not resolved.is_symlink():
        return out
    if not overwrite:
        raise ConfigError(f"output {str(out)!r} already exists", f"pass --overwrite to replace it, or choose another {flag}")
    problem = bundle_problem(resolved)
    if problem is not None:
        raise ConfigError(f"output {str(out)!r} exists and is {problem}; --overwrite replaces only specdec bundles",
                          f"nothing was deleted; remove it yourself if it is really unwanted, or choose another {flag}")
    return out


def bundle_problem(path: Path) -> str | None:
    """None if `path` is a specdec bundle, one that --overwrite may replace: a directory whose manifest.json parses
    as a specdec manifest of this schema version and whose listed files are all present. Else what it is."""
    from specdec.errors import ManifestError
    from specdec.manifest import listed_files, manifest_from_json

    if not path.is_dir():
        return "not a directory"
    manifest_path = path / MANIFEST_NAME
    if not manifest_path.is_file():
        return f"a directory that is not a specdec bundle (no {MANIFEST_NAME})"
    try:
        if manifest_path.stat().st_size > _MANIFEST_LIMIT:
            raise ManifestError(f"{MANIFEST_NAME} is larger than any specdec manifest")
        manifest = manifest_from_json(manifest_path.read_text(encoding="utf-8"))
    except (ManifestError, OSError, UnicodeDecodeError) as exc:
        why = exc.message if isinstance(exc, ManifestError) else type(exc).__name__
        return f"a directory that is not a specdec bundle (its {MANIFEST_NAME} is not a specdec manifest: {why})"
    missing = [rel for rel in listed_files(manifest) if not (path / rel).is_file()]
    if missing:
        return f"not a complete specdec bundle ({missing[0]!r}, listed in its {MANIFEST_NAME}, is missing)"
    return None


def check_output_file(path: str | os.PathLike, overwrite: bool, flag: str) -> Path:
    """Refuse an output file that cannot be written, or that exists without --overwrite, before any work starts."""
    path = Path(path).expanduser()
    if path.is_dir():
        raise ConfigError(f"{flag} {str(path)!r} is a directory", f"pass a file name, e.g. {flag} {path / 'report.md'}")
    if path.exists() or path.is_symlink():
        if not overwrite:
            raise ConfigError(f"{flag} {str(path)!r} already exists", "pass --overwrite to replace it, or choose "
                              "another file")
        if not path.is_file():
            raise ConfigError(f"{flag} {str(path)!r} is not a regular file", "choose a file to write")
    parent = path.parent
    if not parent.is_dir():
        raise ConfigError(f"{flag} {str(path)!r}: the folder {str(parent)!r} does not exist", "create it first")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ConfigError(f"{flag} {str(path)!r}: the folder {str(parent)!r} is not writable", "choose another folder")
    return path


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


def remove_stale_leftovers(parent: Path, name: str) -> list[Path]:
    """Remove `.<name>.<pid>-*.partial|old` entries in `parent` whose owning process is gone; returns them."""
    removed = []
    if not parent.is_dir():
        return removed
    for path in parent.iterdir():
        match = _LEFTOVER.match(path.name)
        if match is None or match["name"] != name or _pid_alive(int(match["pid"])):
            continue
        shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink(missing_ok=True)
        log.warning("removed %s, left behind by process %s, which is gone", path, match["pid"])
        removed.append(path)
    return removed


def staging_dir(out: Path) -> Path:
    """A new hidden directory beside `out`, named for this process; stale ones of dead processes go first."""
    out = Path(out)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        remove_stale_leftovers(out.parent, out.name)
        return Path(tempfile.mkdtemp(prefix=f".{out.name}.{os.getpid()}-", suffix=".partial", dir=out.parent))
    except OSError as exc:
        raise ConfigError(f"cannot write to {str(out.parent)!r}: {exc.strerror}", "choose a writable --out") from exc


def publish_dir(tmp: Path, out: Path) -> None:
    """Replace `out` with the finished `tmp` by renames (an old bundle is moved aside, then removed)."""
    tmp.chmod(0o755)
    for path in tmp.rglob("*"):
        path.chmod(0o755 if path.is_dir() else 0o644)
    old = None
    if out.exists() or out.is_symlink():
        problem = bundle_problem(out)  # it may have changed since check_destination
        if problem is not None:
            raise ConfigError(f"{str(out)!r} is now {problem}; --overwrite replaces only specdec bundles",
                              "nothing was deleted; remove or move it yourself, then run again")
        old = out.with_name(f".{out.name}.{os.getpid()}-{os.urandom(3).hex()}.old")
        out.rename(old)
    tmp.rename(out)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def stop_publishing() -> None:
    """From a signal handler: from now on every staged bundle is removed instead of published."""
    _STOPPING.set()


def stopping() -> bool:
    return _STOPPING.is_set()


@contextlib.contextmanager
def staged_bundle(out: str | os.PathLike) -> Iterator[Path]:
    """Yield a staging directory; on success it replaces `out`, on any error (or signal) it is removed.
    Call check_destination first."""
    out = Path(out)
    tmp = staging_dir(out)
    try:
        yield tmp
        if _STOPPING.is_set():
            raise Terminated()
        publish_dir(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def write_atomic(path: Path, data: bytes | str) -> None:
    """Write a file by a temporary file in the same directory and a rename: readers see old or new, never half."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.{os.getpid()}-", suffix=".partial", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data.encode("utf-8") if isinstance(data, str) else data)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
