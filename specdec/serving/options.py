"""ServeOptions: what `specdec serve` and `build_app` accept, checked once (γ against the bundle's γ_max when the
engine opens the bundle: RequestLayer.gamma)."""
from __future__ import annotations

import os
from dataclasses import dataclass
from enum import StrEnum

from specdec.errors import ConfigError
from specdec.runtime.config import AUTO_BACKEND, BACKEND_CHOICES, checked_int
from specdec.runtime.generator import check_threads


class Speculation(StrEnum):
    """How the server picks γ per round (specdec.serving.goodput.GoodputGamma)."""

    ADAPTIVE = "adaptive"  # from measured goodput
    FIXED = "fixed"  # the bundle's γ
    OFF = "off"  # γ = 0


SPECULATION = tuple(mode.value for mode in Speculation)  # plain strings: argparse prints them
API_KEY_ENV = "SPECDEC_API_KEY"
LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")


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
        if not isinstance(self.port, int) or not 0 <= self.port <= 65535:
            raise ConfigError(f"port {self.port!r} is not a TCP port", "pass --port 0..65535 (0: any free port)")
        if self.max_batch is not None and (not isinstance(self.max_batch, int) or self.max_batch < 1):
            raise ConfigError(f"max_batch must be >= 1, got {self.max_batch!r}", "pass --max-batch 1 or more")
        if not isinstance(self.max_queue, int) or self.max_queue < 0:
            raise ConfigError(f"max_queue must be >= 0, got {self.max_queue!r}", "pass --max-queue 0 or more")
        if self.speculation not in SPECULATION:
            raise ConfigError(f"speculation {self.speculation!r} is unknown", f"choose one of {', '.join(SPECULATION)}")
        object.__setattr__(self, "speculation", Speculation(self.speculation))
        if self.gamma is not None:
            checked_int("gamma", self.gamma, 1, "pass --gamma 1 or more")
        if self.max_body_bytes < 1024:
            raise ConfigError(f"max_body_bytes {self.max_body_bytes} is too small for any request",
                              "pass at least 1024")
        if self.backend not in BACKEND_CHOICES:
            raise ConfigError(f"backend {self.backend!r} is unknown", f"choose one of {', '.join(BACKEND_CHOICES)}")
        if self.api_key is not None and not self.api_key.strip():
            raise ConfigError("the API key is empty", f"pass a non-empty --api-key or set {API_KEY_ENV}")
        if self.api_key is None:
            key_from_env()
        check_threads(self.threads)
        if not isinstance(self.reuse_prefix, bool):
            raise ConfigError(f"reuse_prefix must be True or False, got {self.reuse_prefix!r}",
                              "pass --no-prefix-reuse to turn it off")
        self._check_connection_limits()
        checked_int("prompt_workers", self.prompt_workers, 1, "pass --prompt-workers 1 or more")
        checked_int("prompt_memory_mb", self.prompt_memory_mb, 256, "pass --prompt-worker-memory 256 (MB) or more")
        if isinstance(self.prompt_timeout_s, bool) or not isinstance(self.prompt_timeout_s, (int, float)) \
                or not 0 < self.prompt_timeout_s < 3600:
            raise ConfigError(f"prompt_timeout_s must be a number of seconds in (0, 3600), got {self.prompt_timeout_s!r}",
                              "pass --prompt-timeout 2 (seconds), the default")

    def _check_connection_limits(self) -> None:
        for name, value in (("header_timeout_s", self.header_timeout_s), ("body_timeout_s", self.body_timeout_s),
                            ("drain_s", self.drain_s)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < 86400:
                raise ConfigError(f"{name} must be a number of seconds in (0, 86400), got {value!r}",
                                  "pass a few seconds (the defaults: 10 for headers, 30 for a body, 5 for the drain)")
        checked_int("keep_alive_s", self.keep_alive_s, 1, "pass --keep-alive 1 or more seconds")
        checked_int("max_connections", self.max_connections, 1, "pass --max-connections 1 or more")

    @property
    def key(self) -> str | None:
        """The API key in force: the option, else the environment variable, else none (no check)."""
        return self.api_key or key_from_env()

    @property
    def prompt_budget(self):
        from specdec.serving.prompts import PromptBudget

        return PromptBudget(workers=self.prompt_workers, timeout_s=self.prompt_timeout_s,
                            memory_mb=self.prompt_memory_mb, max_waiting=max(1, self.max_queue))

    @property
    def loopback(self) -> bool:
        """Whether the server binds this machine only (then it answers only requests addressed to it by name)."""
        return self.host in LOOPBACK_HOSTS or self.host.startswith("127.")
