"""`specdec serve --ray` stops on SIGINT and on SIGTERM within its drain and Ray's teardown, and leaves no process of
the Ray instance it started behind (its DashboardAgent and RuntimeEnvAgent were once left running). Skipped only
where the [ray] extra is missing or /proc cannot be read."""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import httpx
import pytest

pytest.importorskip("ray", reason="the [ray] extra is not installed: pip install -e '.[ray]'")

from specdec.serving.ray_app import STOP_MARGIN_S, _descendants  # noqa: E402
from tests.conftest import free_port  # noqa: E402

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads processes from /proc")
DRAIN_S = 2



def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_serve_ray_stops_and_leaves_no_ray_process(gqa_int4_bundle, tmp_path, sig):
    port = free_port()
    command = [sys.executable, "-m", "specdec.cli", "serve", str(gqa_int4_bundle), "--ray", "--replicas", "1",
               "--port", str(port), "--drain-timeout", str(DRAIN_S), "--max-batch", "2"]
    ray_dir = tempfile.mkdtemp(prefix="sr", dir="/tmp")  # short: Ray's socket paths must fit 107 bytes
    env = {**os.environ, "RAY_TMPDIR": ray_dir}  # its own Ray session folder, not a shared /tmp/ray
    log = open(tmp_path / "serve.log", "w+")
    server = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        deadline, ready = time.monotonic() + 240, False
        while time.monotonic() < deadline and server.poll() is None and not ready:
            try:
                ready = httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200
            except httpx.TransportError:
                time.sleep(0.5)
        log.seek(0)
        assert ready, log.read()[-3000:]
        ray_processes = _descendants(server.pid)
        assert len(ray_processes) >= 3, ray_processes  # GCS, raylet, agents, the replica ...
        body = {"model": "gqa", "prompt": "hi", "max_tokens": 2}
        assert httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=60).status_code == 200
        sent = time.monotonic()
        server.send_signal(sig)
        code = server.wait(timeout=DRAIN_S + STOP_MARGIN_S + 20)
        took = time.monotonic() - sent
        log.seek(0)
        assert code == 0, log.read()[-3000:]
        assert took < DRAIN_S + STOP_MARGIN_S + 5
        time.sleep(1.0)
        left = [pid for pid in ray_processes if _running(pid)]
        assert not left, [open(f"/proc/{pid}/cmdline").read().replace("\0", " ")[:120] for pid in left]
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
        log.close()
        shutil.rmtree(ray_dir, ignore_errors=True)
