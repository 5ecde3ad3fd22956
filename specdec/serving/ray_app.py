"""Scale-out on Ray Serve: N replicas of the same app (specdec.serving.app) behind Ray's HTTP proxy.

A thin deployment wrapper: each replica is one process that builds the very app `specdec serve` runs (its own
engine, backends and metrics), with `x-specdec-replica` naming the replica that answered. Ray routes requests
over the replicas and restarts a replica whose process dies; the requests that replica held fail with a 5xx.

    import ray
    from ray import serve
    from specdec.serving.options import ServeOptions
    from specdec.serving.ray_app import build_app

    ray.init()                                     # or ray.init(address="auto") on a cluster node
    serve.start(http_options={"host": "127.0.0.1", "port": 8000})
    serve.run(build_app(ServeOptions(bundle="bundles/smollm2-q41"), replicas=2), name="specdec", route_prefix="/")

On a multi-node cluster every node needs the bundle at the same path (or a shared file system), and each
replica asks Ray for `cpus_per_replica` CPUs, so Ray places replicas where cores are free (README, Serve).
"""
from __future__ import annotations

import dataclasses
import os

from specdec.errors import ConfigError, missing_dependency
from specdec.serving.options import ServeOptions

APP_NAME = "specdec"


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
    if not isinstance(replicas, int) or replicas < 1:
        raise ConfigError(f"replicas must be >= 1, got {replicas!r}", "pass --replicas 1 or more")
    if cpus_per_replica <= 0:
        raise ConfigError(f"cpus_per_replica must be > 0, got {cpus_per_replica}", "pass a positive CPU count")
    serve = _serve()
    threads = options.threads or max(1, int(cpus_per_replica))
    replica_options = dataclasses.replace(options, threads=threads)
    in_flight = (options.max_batch or 8) + options.max_queue  # beyond this the replica answers 429 itself
    deployment = serve.deployment(
        _deployment_class(serve), name="SpecdecReplica", num_replicas=replicas,
        ray_actor_options={"num_cpus": cpus_per_replica}, max_ongoing_requests=in_flight + 1,
        health_check_period_s=2, health_check_timeout_s=30, graceful_shutdown_timeout_s=5,
    )
    return deployment.bind(replica_options)
