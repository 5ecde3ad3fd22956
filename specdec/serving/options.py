"""ServeOptions: what `specdec serve` and `build_app` accept, checked once, each against this machine where it takes
its resources (cores, memory, open files: specdec.runtime.limits); γ and max_batch against the bundle's when the engine
opens it (RequestLayer.gamma, Engine.from_options)."""
from __future__ import annotations

import math
import numbers
import os
from dataclasses import dataclass
from enum import StrEnum

from specdec.errors import ConfigError, shown
from specdec.runtime.config import AUTO_BACKEND, BACKEND_CHOICES, checked_int
from specdec.runtime.generator import check_threads
from specdec.runtime.native_backend import checked_activations
from specdec.runtime.limits import (
    MAX_TIMEOUT_S, bounded_int, bounded_seconds, cpu_count, memory_bytes, open_files_max,
)
from specdec.runtime.prompt_worker import MAX_WAITING, PromptBudget


class Speculation(StrEnum):
    """How the server picks γ per round (specdec.serving.goodput.GoodputGamma)."""

    ADAPTIVE = "adaptive"  # from measured goodput
    FIXED = "fixed"  # the bundle's γ
    OFF = "off"  # γ = 0


SPECULATION = tuple(mode.value for mode in Speculation)  # plain strings: argparse prints them
API_KEY_ENV = "SPECDEC_API_KEY"
LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")
REPLICA_HEADER = "x-specdec-replica"  # a response header naming the Ray Serve replica that answered (ray_app)
MAX_ROWS = 1 << 12  # rows decoded together: far more than a CPU or GPU step gains from
MAX_REPLICAS = 1 << 10  # Ray Serve replicas (and CPUs one asks for) on a cluster, whose cores we cannot count


def check_replicas(replicas, cpus_per_replica, local: bool) -> None:
    """`--replicas` and `--cpus-per-replica`: on a Ray instance this process starts (`local`), within the cores this
    process may use (Ray would leave a replica it has no CPU for waiting for ever); on a cluster, at most
    MAX_REPLICAS of each."""
    cores = cpu_count()
    limit, why = (cores, f"the {cores} cores this process may use") if local else (MAX_REPLICAS, "on a Ray cluster")
    bounded_int("replicas", replicas, 1, limit, why, "pass --replicas 2 (the default), or fewer")
    if isinstance(cpus_per_replica, bool) or not isinstance(cpus_per_replica, numbers.Real) \
            or not math.isfinite(cpus_per_replica) or not 0 < cpus_per_replica <= limit:
        raise ConfigError(f"cpus_per_replica must be a number of CPUs in (0, {limit}] ({why}), got "
                          f"{shown(cpus_per_replica)}", "pass --cpus-per-replica 1 (the default)")
    if local and replicas * cpus_per_replica > cores:
        raise ConfigError(f"{replicas} replicas of {cpus_per_replica:g} CPUs need {replicas * cpus_per_replica:g} "
                          f"CPUs; this process may use {cores}", "pass fewer --replicas or a smaller "
                          "--cpus-per-replica, or join a cluster with --ray-address")


def key_from_env() -> str | None:
    """SPECDEC_API_KEY, or None where it is unset; set but empty (or blank) is refused rather than read as no key."""
    key = os.environ.get(API_KEY_ENV)
    if key is not None and not key.strip():
        raise ConfigError(f"{API_KEY_ENV} is set but empty, which would turn the API key check off",
                          f"set {API_KEY_ENV} to the key, or unset it to serve without one")
    return key


@dataclass(frozen=True)
class ServeOptions:
    bundle: str
    host: str = "127.0.0.1"  # loopback unless told otherwise
    port: int = 8000
    max_batch: int | None = None  # None: the bundle's max_batch
    max_queue: int = 64  # requests waiting for a row; one more is answered 429
    api_key: str | None = None  # None: the SPECDEC_API_KEY environment variable, if set
    model_name: str | None = None  # None: the bundle directory's name
    speculation: Speculation = Speculation.ADAPTIVE
    gamma: int | None = None  # the fixed γ (default: the bundle's); at most the bundle's γ_max
    max_body_bytes: int = 1 << 20
    threads: int | None = None  # onnxruntime intra-op / OpenMP threads (None: every core this process may use)
    backend: str = AUTO_BACKEND  # native where it opens (a batch's rows in one call on either), else onnxruntime
    device: str | None = None  # "cpu" or "cuda:N"; None: load()'s choice for the backend
    activations: str | None = None  # the native target's, "fp32", "int8" or "bf16"; None: the bundle's default (load())
    verify_files: bool = True  # check the bundle's sha256 sums at start
    retry_after_s: int = 1  # the Retry-After of a 429
    header_timeout_s: float = 10.0  # a connection sends a request's headers within this (after opening or a response)
    body_timeout_s: float = 30.0  # a request's body arrives within this of its headers (checked every header_timeout_s)
    keep_alive_s: int = 5  # an idle keep-alive connection closes after this
    max_connections: int = 1000  # open at once (fewer where the open-file limit is lower); at the cap the oldest
    # connection still waiting for a request's headers makes way for a new one
    drain_s: float = 5.0  # on SIGTERM: how long running requests may go on before they end with an error event
    reuse_prefix: bool = True  # skip the prefill of a prompt's prefix whose K/V the slot holds (exact backends only)
    prompt_workers: int = 2  # processes that render chat templates and tokenize long prompts (serving/prompts.py)
    prompt_timeout_s: float = 2.0  # one prompt's rendering and tokenization, at most
    prompt_memory_mb: int = 1024  # one prompt worker's data memory, at most

    def __post_init__(self):
        bounded_int("port", self.port, 0, 65535, "a TCP port", "pass --port 0..65535 (0: any free port)")
        if self.speculation not in SPECULATION:
            raise ConfigError(f"speculation {shown(self.speculation)} is unknown",
                              f"choose one of {', '.join(SPECULATION)}")
        object.__setattr__(self, "speculation", Speculation(self.speculation))
        if self.gamma is not None:
            checked_int("gamma", self.gamma, 1, "pass --gamma 1 or more")
        if self.backend not in BACKEND_CHOICES:
            raise ConfigError(f"backend {shown(self.backend)} is unknown",
                              f"choose one of {', '.join(BACKEND_CHOICES)}")
        if self.api_key is not None and (not isinstance(self.api_key, str) or not self.api_key.strip()):
            raise ConfigError("the API key is empty or not text", f"pass a non-empty --api-key or set {API_KEY_ENV}")
        if self.api_key is None:
            key_from_env()
        check_threads(self.threads)
        if self.activations is not None:
            object.__setattr__(self, "activations", checked_activations(self.activations))
        if not isinstance(self.reuse_prefix, bool):
            raise ConfigError(f"reuse_prefix must be True or False, got {shown(self.reuse_prefix)}",
                              "pass --no-prefix-reuse to turn it off")
        self._check_sizes()
        self._check_connection_limits()
        self.prompt_budget  # noqa: B018 - built to be checked: the prompt workers against this machine

    def _check_sizes(self) -> None:
        """Rows, waiting requests and request bodies, against what this process may hold."""
        memory = memory_bytes()
        if self.max_batch is not None:  # and at most the bundle's max_batch, once the engine opens it
            bounded_int("max_batch", self.max_batch, 1, MAX_ROWS, "the most rows a server decodes together",
                        "pass --max-batch 1 or more, at most the bundle's max_batch (the default)")
        bounded_int("max_queue", self.max_queue, 0, MAX_WAITING, "requests waiting for a row",
                    "pass --max-queue 64 (the default)")
        bounded_int("max_body_bytes", self.max_body_bytes, 1024, memory, "this machine's memory",
                    "pass --max-body-bytes 1048576 (1 MiB, the default)")
        bounded_int("retry_after_s", self.retry_after_s, 0, int(MAX_TIMEOUT_S), "seconds",
                    "pass retry_after_s=1 (the default)")
        for name, flag, count in (("max_queue", "--max-queue", self.max_queue),
                                  ("max_connections", "--max-connections", self.max_connections)):
            if isinstance(count, int) and count * self.max_body_bytes > memory:
                raise ConfigError(f"{name}={count} requests of up to max_body_bytes={self.max_body_bytes} could hold "
                                  f"{count * self.max_body_bytes >> 20} MB, more than this machine's {memory >> 20} MB",
                                  f"pass a smaller {flag} or --max-body-bytes")

    def _check_connection_limits(self) -> None:
        for name, value in (("header_timeout_s", self.header_timeout_s), ("body_timeout_s", self.body_timeout_s),
                            ("drain_s", self.drain_s)):
            bounded_seconds(name, value, MAX_TIMEOUT_S,
                            "pass a few seconds (the defaults: 10 for headers, 30 for a body, 5 for the drain)")
        bounded_int("keep_alive_s", self.keep_alive_s, 1, int(MAX_TIMEOUT_S), "seconds",
                    "pass --keep-alive 5 (seconds), the default")
        files = open_files_max()
        bounded_int("max_connections", self.max_connections, 1, files, "the open files a process may have (fs.nr_open)",
                    "pass --max-connections 1000 (the default)")

    @property
    def key(self) -> str | None:
        """The API key in force: the option, else the environment variable, else none (no check)."""
        return self.api_key or key_from_env()

    @property
    def prompt_budget(self) -> PromptBudget:
        return PromptBudget(workers=self.prompt_workers, timeout_s=self.prompt_timeout_s,
                            memory_mb=self.prompt_memory_mb, max_waiting=max(1, self.max_queue))

    @property
    def loopback(self) -> bool:
        """Whether the server binds this machine only (then it answers only requests addressed to it by name)."""
        return self.host in LOOPBACK_HOSTS or self.host.startswith("127.")
