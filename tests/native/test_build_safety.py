"""The native kernels' library is built and loaded safely, and `auto` fails closed: a corrupt, foreign or other-ABI
cached library is rebuilt; a cache that is not private to the user, or not writable, is not used; processes that
start cold together compile once; every reason native cannot open makes `auto` fall back to onnxruntime, with a
note and one warning; SPECDEC_BACKEND=onnxruntime turns native off; the default thread count honours a cgroup
quota."""
from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from specdec import GenerationConfig
from specdec.native.build import ABI_VERSION
from specdec.errors import BackendError
from specdec.native import build
from specdec.runtime import load
from specdec.runtime.backend import cgroup_cpu_quota
from specdec.runtime.registry import BACKEND_ENV

pytestmark = pytest.mark.skipif(bool(build.missing_cpu_flags()), reason="the native kernels need AVX2, FMA and F16C")


class Records(logging.Handler):
    """The WARNING records of one logger (the suite runs with -p no:logging: no caplog)."""

    def __init__(self, name: str):
        super().__init__(logging.WARNING)
        self.logger, self.records = logging.getLogger(name), []

    def emit(self, record):
        self.records.append(record)

    def __enter__(self):
        self.logger.addHandler(self)
        return self

    def __exit__(self, *exc):
        self.logger.removeHandler(self)

    @property
    def text(self) -> str:
        return "\n".join(record.getMessage() for record in self.records)


def _cached() -> Path:
    return build.library_dir(build.source_key(build.compiler())) / build.LIBRARY_NAME


def _counting_cc(folder: Path) -> Path:
    """A compiler that counts its runs in folder/runs, then runs gcc."""
    cc = folder / "cc"
    cc.write_text(f"#!/bin/sh\necho run >> {folder / 'runs'}\nexec {shutil.which('gcc')} \"$@\"\n")
    cc.chmod(0o755)
    return cc


@pytest.mark.parametrize("damage", ["garbage", "foreign", "other ABI", "other table", "group-writable"])
def test_a_bad_cached_library_is_rebuilt(fresh_build, monkeypatch, damage):
    monkeypatch.setenv("CC", str(_counting_cc(fresh_build)))
    library = _cached()
    library.parent.mkdir(parents=True, exist_ok=True)
    if damage == "garbage":
        library.write_bytes(b"\x7fELF" + b"\x01" * 200)  # a corrupt ELF (once "wrong ELF class" on every load)
    elif damage == "foreign":
        stub = fresh_build / "stub.c"
        stub.write_text(f"int specdec_abi_version(void) {{ return {ABI_VERSION}; }}\n")
        subprocess.run(["gcc", "-shared", "-fPIC", str(stub), "-o", str(library)], check=True)
    elif damage in ("other ABI", "other table"):  # the same ABI built from another table of weight kinds: as foreign
        copies = fresh_build / "src"
        copies.mkdir()
        for path in build.SOURCES + build.HEADERS:
            shutil.copy(path, copies / path.name)
        other_abi = (copies / "specdec_native.h", f"#define SPECDEC_ABI_VERSION {ABI_VERSION}",
                     f"#define SPECDEC_ABI_VERSION {ABI_VERSION - 1}")
        other_table = (copies / "specdec_kinds.h", "SPECDEC_STEP | SPECDEC_PROMPT,  SPECDEC_EVERY_ISA",
                       "SPECDEC_STEP,  SPECDEC_EVERY_ISA")  # kinds without their prompt kernel
        header, old, new = other_abi if damage == "other ABI" else other_table
        assert old in header.read_text()
        header.write_text(header.read_text().replace(old, new))
        subprocess.run(["gcc", *build.FLAGS, *(str(copies / p.name) for p in build.SOURCES), "-o", str(library),
                        "-lm"], check=True)
    else:
        build.compiled()
        library.chmod(0o775)
    before = (fresh_build / "runs").read_text().count("run") if (fresh_build / "runs").exists() else 0
    lib = build.load_kernels()
    assert lib.specdec_abi_version() == ABI_VERSION and lib.specdec_layout_size(0) == 72  # blkq
    assert (fresh_build / "runs").read_text().count("run") == before + 1  # rebuilt once
    build.forget_kernels()
    build.load_kernels()  # and the rebuilt library is used from now on
    assert (fresh_build / "runs").read_text().count("run") == before + 1


@pytest.mark.parametrize("cache", ["group-writable", "a file"])
def test_an_unsafe_or_unusable_cache_builds_privately(fresh_build, monkeypatch, cache):
    root = fresh_build / "cache"
    if cache == "a file":
        root.write_text("not a directory")
    else:
        root.mkdir(mode=0o777)
        root.chmod(0o777)
    with Records("specdec.native.build") as caplog:
        path = build.compiled()  # a CDLL
    folder = Path(path._name).parent  # the private copy it was loaded from
    assert "specdec-native-" in str(folder) and not str(folder).startswith(str(root))
    assert (folder.stat().st_mode & 0o077) == 0
    assert "is not a directory only this user can write" in caplog.text


def test_a_private_build_folder_is_removed_at_exit(fresh_build):
    (fresh_build / "cache").write_text("not a directory")
    code = ("from specdec.native import build; lib = build.compiled(); "
            "assert lib.specdec_abi_version() > 0; print(build._private_tmp())")
    env = {**os.environ, "SPECDEC_CACHE": str(fresh_build / "cache")}
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    folder = Path(run.stdout.strip())
    assert folder.name.startswith("specdec-native-") and not folder.exists()


def test_processes_that_start_cold_compile_once(fresh_build, monkeypatch):
    monkeypatch.setenv("CC", str(_counting_cc(fresh_build)))
    code = f"from specdec.native import build; assert build.load_kernels().specdec_abi_version() == {ABI_VERSION}"
    runs = [subprocess.Popen([sys.executable, "-c", code]) for _ in range(3)]
    assert [run.wait(timeout=300) for run in runs] == [0, 0, 0]
    assert (fresh_build / "runs").read_text().count("run") == 1


@pytest.mark.parametrize("reason", ["no compiler", "no AVX2", "library will not load", "env"])
def test_auto_falls_back_for_every_reason(grid_bundle, fresh_build, monkeypatch, reason):
    from specdec.runtime import registry

    registry._warn_once.cache_clear()
    if reason == "no compiler":
        monkeypatch.setenv("CC", str(fresh_build / "none"))
        monkeypatch.setenv("PATH", str(fresh_build))
    elif reason == "no AVX2":
        monkeypatch.setattr(build, "missing_cpu_flags", lambda: ["avx2"])
    elif reason == "library will not load":  # a compiler that writes garbage
        cc = fresh_build / "cc"
        cc.write_text("#!/bin/sh\nfor a; do o=$a; done\nwhile [ $# -gt 0 ]; do [ \"$1\" = -o ] && o=$2; shift; done\n"
                      "printf 'garbage' > \"$o\"\n")
        cc.chmod(0o755)
        monkeypatch.setenv("CC", str(cc))
    else:
        monkeypatch.setenv(BACKEND_ENV, "onnxruntime")
    config = GenerationConfig(max_new_tokens=6, drafter="none")
    with Records("specdec.runtime.registry") as caplog:
        for _ in range(2):
            with load(grid_bundle) as gen:
                assert gen.backend == "onnxruntime" and "native backend did not open" in gen.backend_note
                assert gen.generate([5, 9, 14], config).token_ids
    warnings = [r for r in caplog.records if r.name == "specdec.runtime.registry"]
    assert len(warnings) == (0 if reason == "env" else 1)  # once per reason, and none for the user's own switch
    if reason == "env":
        with pytest.raises(BackendError, match="turned off") as caught:
            load(grid_bundle, backend="native")
        assert BACKEND_ENV in caught.value.hint


def test_an_unknown_backend_switch_is_refused(grid_bundle, monkeypatch):
    monkeypatch.setenv(BACKEND_ENV, "gpu")
    with pytest.raises(BackendError, match="names no backend"):
        load(grid_bundle, backend="native")


def test_cgroup_quota(tmp_path):
    proc, fs = tmp_path / "cgroup", tmp_path / "fs"
    (fs / "app").mkdir(parents=True)
    proc.write_text("0::/app\n")
    (fs / "app" / "cpu.max").write_text("150000 100000\n")
    assert cgroup_cpu_quota(proc, fs) == 2  # 1.5 CPUs: 2 threads
    (fs / "cpu.max").write_text("100000 100000\n")
    assert cgroup_cpu_quota(proc, fs) == 1  # a parent's smaller quota wins
    (fs / "cpu.max").write_text("max 100000\n")
    (fs / "app" / "cpu.max").write_text("max 100000\n")
    assert cgroup_cpu_quota(proc, fs) is None
    v1 = tmp_path / "v1"
    (v1 / "cpu,cpuacct" / "job").mkdir(parents=True)
    proc.write_text("4:cpu,cpuacct:/job\n1:memory:/job\n")
    (v1 / "cpu,cpuacct" / "job" / "cpu.cfs_quota_us").write_text("400000\n")
    (v1 / "cpu,cpuacct" / "job" / "cpu.cfs_period_us").write_text("100000\n")
    assert cgroup_cpu_quota(proc, v1) == 4
    assert cgroup_cpu_quota(tmp_path / "missing", fs) is None
    assert os.cpu_count() >= 1
