"""`specdec serve --ray` with the default host keeps its local Ray instance on this machine: every listening socket
of every process of the instance (GCS, raylet, agents, Serve's controller, proxy and replica) is on loopback, and
Ray's control plane asks for the instance's token. The sockets are read with psutil, not with the /proc reader the
server checks itself with. Skipped only where the [ray] extra or psutil is missing."""
from __future__ import annotations

import ipaddress
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import httpx
import pytest
from tests.conftest import free_port  # noqa: E402

pytest.importorskip("ray", reason="the [ray] extra is not installed: pip install -e '.[ray]'")
psutil = pytest.importorskip("psutil")

DRAIN_S = 2
READY = "Ray's control plane on loopback"



def _loopback(address: str) -> bool:
    ip = ipaddress.ip_address(address)
    return ip.is_loopback or (ip.version == 6 and ip.ipv4_mapped is not None and ip.ipv4_mapped.is_loopback)


def _listeners(pid: int) -> list:
    """(process name, address, port) of every listening TCP socket of `pid` and the processes below it."""
    root = psutil.Process(pid)
    found = []
    for process in [root, *root.children(recursive=True)]:
        try:
            name, connections = process.name(), process.net_connections(kind="inet")
        except psutil.Error:  # ended meanwhile
            continue
        found += [(name, conn.laddr.ip, conn.laddr.port) for conn in connections if conn.status == psutil.CONN_LISTEN]
    return found


def _wait_ready(server, log, port: int) -> None:
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and server.poll() is None:
        log.seek(0)
        if READY in log.read():
            assert httpx.get(f"http://127.0.0.1:{port}/health", timeout=10).status_code == 200
            return
        time.sleep(0.5)
    log.seek(0)
    pytest.fail(log.read()[-3000:])


def _status_without_token(gcs_port: int, home: str) -> str:
    """`ray status` against the instance's GCS, as a client that holds no token."""
    env = {key: value for key, value in os.environ.items() if not key.startswith("RAY_")}
    env.update(HOME=home, RAY_AUTH_MODE="disabled", RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0")
    ray_cli = os.path.join(os.path.dirname(sys.executable), "ray")
    done = subprocess.run([ray_cli, "status", "--address", f"127.0.0.1:{gcs_port}"], env=env, capture_output=True,
                          text=True, timeout=120)
    return done.stdout + done.stderr


def test_every_listener_of_the_local_ray_instance_is_on_loopback(gqa_int4_bundle, tmp_path):
    port = free_port()
    command = [sys.executable, "-m", "specdec.cli", "serve", str(gqa_int4_bundle), "--ray", "--replicas", "1",
               "--port", str(port), "--drain-timeout", str(DRAIN_S), "--max-batch", "2"]
    ray_dir = tempfile.mkdtemp(prefix="sl", dir="/tmp")  # short: Ray's socket paths must fit 107 bytes
    env = {key: value for key, value in os.environ.items() if not key.startswith("RAY_")}
    env["RAY_TMPDIR"] = ray_dir
    log = open(tmp_path / "serve.log", "w+")
    server = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        _wait_ready(server, log, port)
        found = _listeners(server.pid)
        names = {name for name, _, _ in found}
        assert {"gcs_server", "raylet"} <= names and any(name.startswith("ray::ServeRepli") for name in names), found
        assert port in {listening_port for _, _, listening_port in found}, found  # Ray's HTTP proxy
        assert [listener for listener in found if not _loopback(listener[1])] == [], found
        gcs_port = next(listening_port for name, _, listening_port in found if name == "gcs_server")
        assert "Authentication token is missing or incorrect" in _status_without_token(gcs_port, str(tmp_path))
        server.send_signal(signal.SIGTERM)
        log.seek(0)
        assert server.wait(timeout=120) == 0, log.read()[-3000:]
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
        log.close()
        shutil.rmtree(ray_dir, ignore_errors=True)
