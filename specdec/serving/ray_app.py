"""Scale-out on Ray Serve: N replicas of the same app (specdec.serving.app) behind Ray's HTTP proxy.

A thin deployment wrapper: each replica is one process that builds the very app `specdec serve` runs (its own
engine, backends and metrics), with `x-specdec-replica` naming the replica that answered. Ray routes requests
over the replicas and restarts a replica whose process dies; the requests that replica held fail with a 5xx.

    from specdec.serving.options import ServeOptions
    from specdec.serving.ray_app import build_app
    from specdec.serving.ray_local import local_ray_env

    with local_ray_env():                          # before ray is imported: loopback and a token (ray_local)
        import ray
        from ray import serve

        ray.init(address="local", include_dashboard=False)   # or ray.init(address="auto") on a cluster node
        serve.start(http_options={"host": "127.0.0.1", "port": 8000})
        serve.run(build_app(ServeOptions(bundle="bundles/smollm2-q41"), replicas=2), name="specdec",
                  route_prefix="/")

On a multi-node cluster every node needs the bundle at the same path (or a shared file system), and each
replica asks Ray for `cpus_per_replica` CPUs, so Ray places replicas where cores are free (README, Serve).
"""
from __future__ import annotations

import dataclasses
import logging
import os
import signal
import sys
import threading
import time

from specdec.errors import ConfigError, missing_dependency
from specdec.serving.options import REPLICA_HEADER, ServeOptions, check_replicas
from specdec.serving.ray_local import (LOOPBACK, WILDCARD_HOSTS, can_list, listeners, local_ray_env, refuse_exposed,
                                      replica_grpc_on_loopback)

logger = logging.getLogger(__name__)
APP_NAME = "specdec"
STOP_MARGIN_S = 20  # past the drain: Ray's own teardown (proxy, controller, raylet, agents) on a busy machine


def _serve():
    try:
        from ray import serve
    except ImportError as exc:
        raise missing_dependency("ray", "ray") from exc
    return serve


def _deployment_class(serve):
    @serve.ingress()
    class SpecdecReplica:
        """One replica: the server app, built at replica start (its lifespan loads the bundle)."""

        def __init__(self, options: ServeOptions):
            self.options = options
            self.server_app = None  # not `app`: Ray's wrapper owns that name

        def __serve_build_asgi_app__(self):
            from specdec.serving.app import build_app as build_server_app

            replica_grpc_on_loopback()  # before Serve starts the replica's gRPC server, once this returns
            replica = serve.get_replica_context().replica_id.unique_id
            self.server_app = build_server_app(self.options, replica=replica)
            return self.server_app

        def check_health(self) -> None:
            engine = self.server_app.state.engine if self.server_app is not None else None
            if engine is not None and not engine.running:
                raise RuntimeError("the specdec engine stopped")

        def pid(self) -> int:
            """The replica's process id (for operators and the replica-kill test; not served over HTTP)."""
            return os.getpid()

    return SpecdecReplica


def build_app(options: ServeOptions, replicas: int = 2, cpus_per_replica: float = 1.0):
    """A Ray Serve application of `replicas` copies of the server; run it with `serve.run(..., route_prefix="/")`.
    Each replica runs onnxruntime on `cpus_per_replica` threads unless `options.threads` says otherwise."""
    check_replicas(replicas, cpus_per_replica, local=False)  # the CLI checks a local instance against our cores
    serve = _serve()
    threads = options.threads or max(1, int(cpus_per_replica))
    replica_options = dataclasses.replace(options, threads=threads)
    in_flight = (options.max_batch or 8) + options.max_queue  # beyond this the replica answers 429 itself
    deployment = serve.deployment(
        _deployment_class(serve), name="SpecdecReplica", num_replicas=replicas,
        ray_actor_options={"num_cpus": cpus_per_replica}, max_ongoing_requests=in_flight + 1,
        health_check_period_s=2, health_check_timeout_s=30, graceful_shutdown_timeout_s=options.drain_s,
    )
    return deployment.bind(replica_options)


def run_ray(options: ServeOptions, replicas: int, cpus_per_replica: float, address: str | None) -> int:
    """`specdec serve --ray`: deploy the replicas, serve until SIGINT or SIGTERM, then stop within the drain and
    Ray's teardown (STOP_MARGIN_S). A Ray instance this process starts (no `address`) keeps its control plane on
    loopback behind a token of its own (specdec.serving.ray_local), is refused (ExposureError) where a process of it
    listens elsewhere but on the API's port, and is shut down with every process it started, Ray's agents included;
    a cluster it joined is left running, without the app."""
    if address is not None:
        return _run_ray(options, replicas, cpus_per_replica, address)
    with local_ray_env():  # before the first `import ray`: Ray reads it then
        return _run_ray(options, replicas, cpus_per_replica, None)


def _run_ray(options: ServeOptions, replicas: int, cpus_per_replica: float, address: str | None) -> int:
    serve = _serve()
    import ray

    application = build_app(options, replicas, cpus_per_replica)
    stop = threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGINT, signal.SIGTERM)}
    own = address is None
    try:
        if own:  # "local": always a new instance, never one RAY_ADDRESS names or `ray start` left running
            ray.init(address="local", _node_ip_address=LOOPBACK, include_dashboard=False, dashboard_host=LOOPBACK)
        else:
            ray.init(address=address)
        for sig in previous:  # ray.init may install handlers of its own
            signal.signal(sig, lambda *_: stop.set())
        if not stop.is_set():
            serve.start(http_options={"host": options.host, "port": options.port})
            serve.run(application, name=APP_NAME, route_prefix="/")
            _check_answering(options)
            checked = _check_loopback(ray, options) if own else ""
            print(f"specdec: {replicas} Ray Serve replicas on http://{options.host}:{options.port}/v1{checked}; "
                  "Ctrl-C or SIGTERM stops", file=sys.stderr)
        stop.wait()
    finally:
        print("specdec: stopping the Ray Serve replicas", file=sys.stderr)
        _stop(serve, ray, own, options.drain_s + STOP_MARGIN_S)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 0


def _check_answering(options: ServeOptions) -> None:
    """ConfigError where the API's port answers without a replica's `x-specdec-replica` header: another process
    (one of Ray's own agents picks a free port at random) held the port before Ray Serve's proxy could bind it."""
    import urllib.error
    import urllib.request

    host = LOOPBACK if options.host in WILDCARD_HOSTS else options.host
    url = f"http://{host}:{options.port}/health"
    try:
        with urllib.request.urlopen(url, timeout=30) as response:
            headers = response.headers
    except urllib.error.HTTPError as exc:  # a 503 from a replica still names it
        headers = exc.headers
    except OSError as exc:
        raise ConfigError(f"the Ray Serve replicas are deployed but {url} does not answer ({exc})",
                          hint="another process may hold the port: choose a free one with --port") from exc
    if REPLICA_HEADER not in headers:
        raise ConfigError(f"port {options.port} answers {url} without a specdec replica: another process holds it",
                          hint="choose a free port with --port (one below the kernel's ephemeral range, "
                               "/proc/sys/net/ipv4/ip_local_port_range, is never handed to Ray's own agents)")


def _check_loopback(ray, options: ServeOptions) -> str:
    """Refuse the local instance (ExposureError) where its node or a listening socket of one of its processes is
    off loopback, the API's own port aside where --host is not loopback; -> a note for the start-up line."""
    if not can_list():
        logger.warning("cannot list listening sockets here (no /proc/net/tcp): the Ray instance is not checked")
        return ""
    found = listeners([os.getpid(), *_descendants(os.getpid())])
    refuse_exposed(ray.util.get_node_ip_address(), found, None if options.loopback else options.port)
    return f"; Ray's control plane on loopback ({len(found)} listening sockets checked)"


def _stop(serve, ray, own: bool, budget_s: float) -> None:
    """Delete the app (its replicas drain), shut Ray down, and where this process started the instance, end every
    process it started that is still there; all within `budget_s`, the last step by force if need be."""
    started = _descendants(os.getpid()) if own else []
    done = threading.Event()

    def shut_down():
        try:
            if own:
                serve.shutdown()
            else:
                serve.delete(APP_NAME)
            ray.shutdown()
        except Exception as exc:  # noqa: BLE001 - a failed teardown still ends the processes below
            print(f"specdec: Ray's shutdown failed ({type(exc).__name__}: {exc})", file=sys.stderr)
        finally:
            done.set()

    threading.Thread(target=shut_down, daemon=True, name="specdec-ray-stop").start()
    if not done.wait(budget_s):
        print(f"specdec: Ray did not stop within {budget_s:.0f} s; ending its processes", file=sys.stderr)
    _end(started)


def _descendants(pid: int) -> list:
    """Every process below `pid` (Linux /proc; empty elsewhere): Ray's GCS, raylet, agents and workers."""
    children: dict = {}
    try:
        entries = [e for e in os.listdir("/proc") if e.isdigit()]
    except OSError:
        return []
    for entry in entries:
        try:
            with open(f"/proc/{entry}/stat", encoding="ascii", errors="replace") as handle:
                parent = int(handle.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(parent, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), ()):
            found.append(child)
            todo.append(child)
    return found


def _end(pids: list, grace_s: float = 3.0) -> None:
    """SIGTERM the processes of `pids` still running, then SIGKILL those that outlast `grace_s`."""
    def alive(pid):
        try:
            os.kill(pid, 0)
        except OSError:
            return False
        try:
            with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as handle:
                return handle.read().rsplit(")", 1)[1].split()[0] != "Z"
        except OSError:
            return True

    def send(sig, to):
        for pid in to:
            try:
                os.kill(pid, sig)
            except OSError:  # gone meanwhile
                pass

    left = [pid for pid in pids if alive(pid)]
    send(signal.SIGTERM, left)
    deadline = time.monotonic() + grace_s
    while left and time.monotonic() < deadline:
        time.sleep(0.1)
        left = [pid for pid in left if alive(pid)]
    send(signal.SIGKILL, left)
