"""ServeOptions: what `specdec serve` and `build_app` accept, checked once."""
from __future__ import annotations

import os
from dataclasses import dataclass

from specdec.errors import ConfigError
from specdec.runtime.config import CPU_BACKENDS

SPECULATION = ("adaptive", "fixed", "off")
API_KEY_ENV = "SPECDEC_API_KEY"


@dataclass(frozen=True)
class ServeOptions:
    bundle: str
    host: str = "127.0.0.1"  # loopback unless told otherwise
    port: int = 8000
    max_batch: int | None = None  # None: the bundle's max_batch
    max_queue: int = 64  # requests waiting for a row; one more is answered 429
    api_key: str | None = None  # None: the SPECDEC_API_KEY environment variable, if set
    model_name: str | None = None  # None: the bundle directory's name
    speculation: str = "adaptive"  # γ per round from measured goodput; "fixed": the bundle's γ; "off": γ = 0
    gamma: int | None = None  # the fixed γ (default: the bundle's)
    max_body_bytes: int = 1 << 20
    threads: int | None = None  # onnxruntime intra-op / OpenMP threads (None: every core this process may use)
    backend: str = "onnxruntime"  # "native": specdec's own 4-bit kernels (rows one by one); "auto": native where it opens
    verify_files: bool = True  # check the bundle's sha256 sums at start
    retry_after_s: int = 1  # the Retry-After of a 429

    def __post_init__(self):
        if not isinstance(self.port, int) or not 0 <= self.port <= 65535:
            raise ConfigError(f"port {self.port!r} is not a TCP port", "pass --port 0..65535 (0: any free port)")
        if self.max_batch is not None and (not isinstance(self.max_batch, int) or self.max_batch < 1):
            raise ConfigError(f"max_batch must be >= 1, got {self.max_batch!r}", "pass --max-batch 1 or more")
        if not isinstance(self.max_queue, int) or self.max_queue < 0:
            raise ConfigError(f"max_queue must be >= 0, got {self.max_queue!r}", "pass --max-queue 0 or more")
        if self.speculation not in SPECULATION:
            raise ConfigError(f"speculation {self.speculation!r} is unknown", f"choose one of {', '.join(SPECULATION)}")
        if self.gamma is not None and (not isinstance(self.gamma, int) or self.gamma < 1):
            raise ConfigError(f"gamma must be >= 1, got {self.gamma!r}", "pass --gamma 1 or more")
        if self.max_body_bytes < 1024:
            raise ConfigError(f"max_body_bytes {self.max_body_bytes} is too small for any request",
                              "pass at least 1024")
        if self.backend not in CPU_BACKENDS:
            raise ConfigError(f"backend {self.backend!r} is unknown", f"choose one of {', '.join(CPU_BACKENDS)}")
        if self.api_key is not None and not self.api_key:
            raise ConfigError("the API key is empty", f"pass a non-empty --api-key or set {API_KEY_ENV}")

    @property
    def key(self) -> str | None:
        """The API key in force: the option, else the environment variable, else none (no check)."""
        return self.api_key or os.environ.get(API_KEY_ENV) or None
