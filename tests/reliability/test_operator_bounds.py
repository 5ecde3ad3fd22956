"""Every operator option is bounded by what this machine can give (specdec.runtime.limits): a count of processes by
its cores, a size by its memory, connections by its open files, a wait by an hour. A refusal names the option, the
value and the limit, with a hint, before anything starts; and a SIGTERM during the server's start-up ends it at once
(the prompt workers start where the CLI's signal handling reaches them)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from specdec.cli import main
from specdec.errors import ConfigError
from specdec.runtime.limits import MAX_TIMEOUT_S, PER_CORE, cpu_count, memory_bytes, open_files_max
from specdec.runtime.prompt_worker import PromptBudget

CORES, MEMORY_MB = cpu_count(), memory_bytes() >> 20


def _options(**fields):
    from specdec.serving.options import ServeOptions

    return ServeOptions(bundle="b", **fields)


@pytest.mark.parametrize("fields, message, hint", [
    (dict(prompt_workers=1_000_000), f"prompt workers must be an integer in 1..{PER_CORE * CORES} ({PER_CORE} "
     f"per core of the {CORES} cores this process may use), got 1000000", "--prompt-workers"),
    (dict(prompt_workers=0), "prompt workers must be an integer in 1..", "--prompt-workers"),
    (dict(prompt_memory_mb=MEMORY_MB + 1), f"prompt worker memory_mb must be an integer in 256..{MEMORY_MB} (this "
                                           f"machine's memory), got {MEMORY_MB + 1}", "--prompt-worker-memory"),
    (dict(prompt_workers=PER_CORE * CORES, prompt_memory_mb=MEMORY_MB // 2 + 1),
     f"prompt workers of {MEMORY_MB // 2 + 1} MB could take", "--prompt-workers"),
    (dict(prompt_timeout_s=1e9), "prompt timeout_s must be a number of seconds in (0, 3600], got 1000000000",
     "--prompt-timeout"),
    (dict(prompt_timeout_s=float("inf")), "got inf", "--prompt-timeout"),
    (dict(max_queue=10**9), "max_queue must be an integer in 0..65536 (requests waiting for a row), got 1000000000",
     "--max-queue"),
    (dict(max_queue=60_000, max_body_bytes=1 << 30), "max_queue=60000 requests of up to max_body_bytes=1073741824",
     "--max-queue"),
    (dict(max_batch=10**9), "max_batch must be an integer in 1..4096", "--max-batch"),
    (dict(max_batch=True), "max_batch must be an integer in 1..4096", "--max-batch"),
    (dict(max_body_bytes=memory_bytes() + 1), "max_body_bytes must be an integer in 1024..", "--max-body-bytes"),
    (dict(max_connections=10**5, max_body_bytes=(memory_bytes() >> 16) + 1), "max_connections=100000 requests of up",
     "--max-connections"),
    (dict(max_connections=open_files_max() + 1, max_body_bytes=1024), "max_connections must be an integer in 1..",
     "--max-connections"),
    (dict(keep_alive_s=10**6), "keep_alive_s must be an integer in 1..3600 (seconds), got 1000000", "--keep-alive"),
    (dict(header_timeout_s=float("nan")), "header_timeout_s must be a number of seconds in (0, 3600], got nan",
     "the defaults"),
    (dict(drain_s=MAX_TIMEOUT_S + 1), "drain_s must be a number of seconds in (0, 3600]", "the defaults"),
    (dict(port=True), "port must be an integer in 0..65535 (a TCP port), got True", "--port"),
    (dict(retry_after_s=-1), "retry_after_s must be an integer in 0..3600", "retry_after_s=1"),
])
def test_serve_options_are_bounded_by_this_machine(fields, message, hint):
    with pytest.raises(ConfigError) as info:
        _options(**fields)
    assert message in info.value.message, info.value.message
    assert hint in info.value.hint, info.value.hint


def test_the_defaults_fit_and_the_limits_themselves_are_accepted():
    assert _options().prompt_budget == PromptBudget(workers=2, timeout_s=2.0, memory_mb=1024, max_waiting=64)
    _options(prompt_workers=PER_CORE * CORES, prompt_memory_mb=256, keep_alive_s=3600, drain_s=MAX_TIMEOUT_S,
             max_queue=65536, max_body_bytes=1024, max_batch=4096)


@pytest.mark.parametrize("replicas, cpus, local, message", [
    (1_000_000, 1.0, True, f"replicas must be an integer in 1..{CORES} (the {CORES} cores this process may use)"),
    (1_000_000, 1.0, False, "replicas must be an integer in 1..1024 (on a Ray cluster)"),
    (1, float("nan"), True, f"cpus_per_replica must be a number of CPUs in (0, {CORES}]"),
    (1, 0, False, "cpus_per_replica must be a number of CPUs in (0, 1024]"),
    (CORES, 1.5, True, f"{CORES} replicas of 1.5 CPUs need"),
])
def test_ray_replicas_are_bounded(replicas, cpus, local, message):
    from specdec.serving.options import check_replicas

    with pytest.raises(ConfigError) as info:
        check_replicas(replicas, cpus, local)
    assert message in info.value.message, info.value.message
    assert "--replicas" in info.value.hint or "--cpus-per-replica" in info.value.hint, info.value.hint


def test_serve_cli_refuses_absurd_options_before_opening_anything(tmp_path, capsys):
    missing = str(tmp_path / "no-bundle")  # never read: the options are refused first
    for flags, message in ((["--prompt-workers", "1000000"], "prompt workers must be an integer in 1.."),
                           (["--max-queue", "1000000000"], "max_queue must be an integer in 0..65536"),
                           (["--max-batch", "1000000000"], "max_batch must be an integer in 1..4096"),
                           (["--keep-alive", "100000000"], "keep_alive_s must be an integer in 1..3600"),
                           (["--drain-timeout", "inf"], "drain_s must be a number of seconds"),
                           (["--ray", "--replicas", "1000000"], "replicas must be an integer in 1..")):
        assert main(["serve", missing, "--port", "0", *flags]) == 1
        err = capsys.readouterr().err
        assert message in err and "Hint:" in err and "Traceback" not in err and "does not exist" not in err, err


def test_max_batch_above_the_bundles_is_refused(gqa_int4_bundle):
    from specdec.serving.engine import Engine
    from specdec.serving.options import ServeOptions

    with pytest.raises(ConfigError, match="max_batch=8 exceeds this bundle's max_batch of 4 rows") as info:
        Engine.from_options(ServeOptions(bundle=str(gqa_int4_bundle), max_batch=8))
    assert "--max-batch 4 or less" in info.value.hint


def test_memory_is_read_from_meminfo_and_capped_by_cgroups(tmp_path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       16384000 kB\nMemFree:        1000 kB\n")
    fs = tmp_path / "cgroup"
    (fs / "a" / "b").mkdir(parents=True)
    (fs / "a" / "memory.max").write_text("2147483648\n")
    (fs / "a" / "b" / "memory.max").write_text("max\n")
    proc = tmp_path / "self-cgroup"
    proc.write_text("0::/a/b\n")
    assert memory_bytes(meminfo, proc, fs) == 2 << 30
    proc.write_text("4:memory:/c\n1:cpu:/\n")
    (fs / "memory" / "c").mkdir(parents=True)
    (fs / "memory" / "c" / "memory.limit_in_bytes").write_text(str(1 << 30))
    assert memory_bytes(meminfo, proc, fs) == 1 << 30
    assert memory_bytes(meminfo, tmp_path / "none", fs) == 16384000 << 10


def _children(pid: int) -> set:
    """The live (not zombie) child processes of `pid`."""
    found = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                fields = open(f"/proc/{entry}/stat").read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid and fields[0] != "Z":
                found.add(int(entry))
    return found


def _wait_gone(pids: set, timeout_s: float = 10) -> set:
    deadline = time.monotonic() + timeout_s
    while pids and time.monotonic() < deadline:
        pids = {pid for pid in pids if pid in _children(os.getppid()) | _children(os.getpid())}
        time.sleep(0.1)
    return pids


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads processes from /proc")
def test_a_signal_ends_the_prompt_workers_start_and_kills_what_started(gqa_int4_bundle):
    """PromptPool.open() waits in the calling thread: a signal whose handler raises (the CLI's SIGTERM handler raises
    Terminated) ends the wait at once, and every worker started or starting is killed."""
    from specdec.errors import Terminated
    from specdec.serving.prompts import PromptPool

    def terminate(signum, frame):
        raise Terminated()

    before = _children(os.getpid())
    previous = signal.signal(signal.SIGALRM, terminate)
    pool = PromptPool(gqa_int4_bundle, PromptBudget(workers=PER_CORE * CORES, memory_mb=256))
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.2)  # a worker takes longer than this to import the runtime
        with pytest.raises(Terminated):
            pool.open()
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    assert pool._closed
    assert not _wait_gone(_children(os.getpid()) - before), "a prompt worker outlived the interrupted start"


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads processes from /proc")
def test_sigterm_during_start_up_ends_the_server_cleanly(gqa_int4_bundle):
    """The report's case: SIGTERM while the prompt workers start was ignored until SIGKILL. Now the workers start
    before uvicorn, where the CLI turns SIGTERM into Terminated: the process ends with 143 and no traceback, and no
    worker outlives it."""
    command = [sys.executable, "-m", "specdec.cli", "serve", str(gqa_int4_bundle), "--port", "0",
               "--prompt-workers", str(PER_CORE * CORES), "--prompt-worker-memory", "256"]
    server = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline, workers = time.monotonic() + 120, set()
        while time.monotonic() < deadline and server.poll() is None and not workers:
            workers = _children(server.pid)  # the first prompt worker: the start-up is under way
            time.sleep(0.05)
        assert workers, "no prompt worker started"
        server.send_signal(signal.SIGTERM)
        assert server.wait(timeout=30) == 143
        err = server.stderr.read()
        assert "terminated" in err and "Traceback" not in err, err
        time.sleep(0.5)
        assert not [pid for pid in workers if os.path.exists(f"/proc/{pid}/stat")
                    and open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z"]
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
