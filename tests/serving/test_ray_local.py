"""The listener check of `specdec serve --ray`'s local Ray instance (specdec.serving.ray_local), without Ray: real
sockets of this process read back from /proc, and synthetic listeners off loopback refused with the process, the
address and a hint. The instance itself is checked in test_serve_ray_loopback.py."""
from __future__ import annotations

import http.server
import os
import re
import socket
import sys
import threading

import pytest

from specdec.errors import ConfigError, ExposureError
from specdec.serving import ray_local
from specdec.serving.options import ServeOptions
from specdec.serving.ray_app import _check_answering
from specdec.serving.ray_local import Listener, is_loopback, listeners, local_ray_env, refuse_exposed

needs_proc = pytest.mark.skipif(not ray_local.can_list(), reason="reads sockets from /proc/net/tcp (Linux)")


def _listening(family: int, host: str) -> socket.socket:
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.bind((host, 0))
    sock.listen(1)
    return sock


@needs_proc
def test_a_loopback_socket_of_a_process_is_found_and_passes():
    with _listening(socket.AF_INET, "127.0.0.1") as sock:
        port = sock.getsockname()[1]
        found = [listener for listener in listeners([os.getpid()]) if listener.port == port]
        assert [(listener.pid, listener.address) for listener in found] == [(os.getpid(), "127.0.0.1")]
        refuse_exposed("127.0.0.1", found)


@needs_proc
@pytest.mark.parametrize("host", ["::1", "::ffff:127.0.0.1"])  # the second as Ray's gRPC servers bind loopback
def test_an_ipv6_loopback_socket_is_read_from_tcp6(host):
    try:
        sock = _listening(socket.AF_INET6, host)
    except OSError:
        pytest.skip("no IPv6 loopback here")
    with sock:
        port = sock.getsockname()[1]
        found = [listener for listener in listeners([os.getpid()]) if listener.port == port]
        assert [listener.address for listener in found] == [host]
        refuse_exposed("127.0.0.1", found)


@needs_proc
def test_a_process_that_is_gone_has_no_listeners():
    assert listeners([2 ** 22 + 7]) == []  # above Linux's pid_max


@pytest.mark.parametrize("address", ["127.0.0.1", "127.0.0.53", "::1", "::ffff:127.0.0.1"])
def test_loopback_addresses(address):
    assert is_loopback(address)


@pytest.mark.parametrize("address", ["0.0.0.0", "::", "192.0.2.2", "::ffff:192.0.2.2", "fe80::1"])
def test_addresses_beyond_loopback(address):
    assert not is_loopback(address)


LOOPBACK_ONES = [Listener(11, "gcs_server", "::ffff:127.0.0.1", 6379), Listener(12, "raylet", "127.0.0.1", 40001)]


@pytest.mark.parametrize(("address", "shown"), [("0.0.0.0", "0.0.0.0:41259"), ("::", "[::]:41259"),
                                                 ("192.0.2.2", "192.0.2.2:41259")])
def test_a_listener_off_loopback_is_refused_with_its_process_and_address(address, shown):
    exposed = Listener(13, "ray::ServeRepli", address, 41259)
    with pytest.raises(ExposureError) as error:
        refuse_exposed("127.0.0.1", [*LOOPBACK_ONES, exposed])
    assert f"ray::ServeRepli (pid 13) on {shown}" in error.value.message
    assert "gcs_server" not in error.value.message
    assert "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER" in error.value.hint


def test_every_listener_off_loopback_is_named():
    exposed = [Listener(13, "gcs_server", "::", 6379), Listener(14, "raylet", "0.0.0.0", 40001)]
    with pytest.raises(ExposureError, match=re.escape("gcs_server (pid 13) on [::]:6379; raylet (pid 14) on "
                                                      "0.0.0.0:40001")):
        refuse_exposed("127.0.0.1", exposed)


def test_a_node_registered_off_loopback_is_refused():
    with pytest.raises(ExposureError, match="registered its node under 192.0.2.2, not loopback") as error:
        refuse_exposed("192.0.2.2", LOOPBACK_ONES)
    assert error.value.hint


def test_only_the_api_port_may_listen_beyond_loopback_where_the_api_is_exposed():
    proxy = Listener(15, "ray::ProxyActor", "0.0.0.0", 8000)
    refuse_exposed("127.0.0.1", [*LOOPBACK_ONES, proxy], api_port=8000)
    with pytest.raises(ExposureError, match=re.escape("ray::ProxyActor (pid 15) on 0.0.0.0:8000")):
        refuse_exposed("127.0.0.1", [*LOOPBACK_ONES, proxy])  # a loopback --host: no exception
    with pytest.raises(ExposureError, match=re.escape("raylet (pid 16) on [::]:40002")):
        refuse_exposed("127.0.0.1", [proxy, Listener(16, "raylet", "::", 40002)], api_port=8000)


RAY_ENV = (ray_local.LOCAL_ONLY_ENV, ray_local.AUTH_MODE_ENV, ray_local.TOKEN_ENV, ray_local.TOKEN_PATH_ENV)


@pytest.fixture
def fresh(monkeypatch):
    """A process as `specdec serve --ray` starts: no Ray settings in the environment, ray not imported yet (other
    test modules import it; it is out of sys.modules for the test only)."""
    for name in RAY_ENV:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.delitem(sys.modules, "ray", raising=False)
    return monkeypatch


def test_the_local_environment_asks_for_loopback_and_a_token_of_its_own_then_is_restored(fresh):
    monkeypatch = fresh
    monkeypatch.setenv(ray_local.AUTH_MODE_ENV, "disabled")
    with local_ray_env():
        assert os.environ[ray_local.LOCAL_ONLY_ENV] == "0"
        assert os.environ[ray_local.AUTH_MODE_ENV] == "token"
        token = os.environ[ray_local.TOKEN_ENV]
        assert re.fullmatch("[0-9a-f]{64}", token)
    with local_ray_env():
        assert os.environ[ray_local.TOKEN_ENV] != token  # each instance its own
    assert os.environ[ray_local.AUTH_MODE_ENV] == "disabled"
    assert ray_local.LOCAL_ONLY_ENV not in os.environ and ray_local.TOKEN_ENV not in os.environ


@pytest.mark.parametrize("given", [ray_local.TOKEN_ENV, ray_local.TOKEN_PATH_ENV])
def test_a_token_the_environment_names_is_kept(fresh, given):
    fresh.setenv(given, "operator-token-or-path")
    with local_ray_env():
        assert os.environ[given] == "operator-token-or-path"
        assert os.environ.get(ray_local.TOKEN_ENV, "operator-token-or-path") == "operator-token-or-path"


def test_ray_imported_under_other_settings_is_refused_before_ray_starts(monkeypatch):
    pytest.importorskip("ray", reason="the [ray] extra is not installed")
    for name in RAY_ENV:
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(ExposureError, match="ray was imported before specdec could keep its local instance on "
                                            "loopback") as error:
        with local_ray_env():
            pytest.fail("entered")
    assert "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=None" in error.value.message
    assert "specdec serve --ray` as its own command" in error.value.hint
    assert ray_local.LOCAL_ONLY_ENV not in os.environ


def test_ray_imported_under_the_local_settings_is_let_through(monkeypatch):
    pytest.importorskip("ray", reason="the [ray] extra is not installed")
    for name, value in ray_local.LOCAL_SETTINGS.items():
        monkeypatch.setenv(name, value)
    with local_ray_env():
        assert os.environ[ray_local.LOCAL_ONLY_ENV] == "0"


class _Answer(http.server.BaseHTTPRequestHandler):
    replica: str | None = None

    def do_GET(self):  # noqa: N802 - http.server's name
        self.send_response(200)
        if self.replica is not None:
            self.send_header("x-specdec-replica", self.replica)
        self.end_headers()

    def log_message(self, *args):
        pass


@pytest.mark.parametrize("replica", [None, "r0"], ids=["another-process", "a-replica"])
def test_the_api_port_must_answer_from_a_replica(replica):
    """serve --ray refuses a port another process answers on (one of Ray's agents took it once, before the
    proxy), and passes one a replica answers on."""
    handler = type("Answer", (_Answer,), {"replica": replica})
    with http.server.HTTPServer(("127.0.0.1", 0), handler) as server:
        threading.Thread(target=server.serve_forever, daemon=True).start()
        options = ServeOptions(bundle="b", port=server.server_address[1])
        try:
            if replica is None:
                with pytest.raises(ConfigError, match=f"port {options.port} answers .* without a specdec replica"
                                   r"(.|\n)*Hint: choose a free port"):
                    _check_answering(options)
            else:
                _check_answering(options)
        finally:
            server.shutdown()


def test_a_port_nothing_answers_on_is_refused():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with pytest.raises(ConfigError, match="does not answer"):
        _check_answering(ServeOptions(bundle="b", port=port))
