"""The one error hierarchy of specdec. Every message says what failed, the value seen, and a `Hint:`."""
from __future__ import annotations


class SpecDecError(Exception):
    """Base of every error specdec raises on purpose."""

    def __init__(self, message: str, hint: str | None = None):
        self.message = message
        self.hint = hint
        super().__init__(message if hint is None else f"{message}\nHint: {hint}")


class ConfigError(SpecDecError):
    """An option or argument has a value that cannot work."""


class ManifestError(SpecDecError):
    """A bundle or its manifest is missing, corrupt or inconsistent."""


class ExportError(SpecDecError):
    """Exporting a model to ONNX failed or produced a graph that disagrees with PyTorch."""


class EngineBuildError(SpecDecError):
    """Building a backend engine (TensorRT plan, optimized ONNX) failed."""


class MissingDependencyError(SpecDecError):
    """An optional dependency is not installed; the hint names the extra."""


class CapacityError(SpecDecError):
    """A request does not fit the static buffers (sequence length, batch)."""


class BackendError(SpecDecError):
    """A runtime backend cannot run as asked (device, provider, engine)."""


class ExposureError(SpecDecError):
    """A service would be reachable beyond what it was asked for (a local Ray instance's ports off loopback)."""


def missing_dependency(module: str, extra: str) -> MissingDependencyError:
    """Build the error for an optional module that failed to import."""
    return MissingDependencyError(
        f"the optional dependency {module!r} is not installed",
        f"pip install 'specdec[{extra}]'",
    )


class Terminated(KeyboardInterrupt):
    """The process was asked to stop (SIGTERM); raised like Ctrl-C so that every `finally` and cleanup runs."""
