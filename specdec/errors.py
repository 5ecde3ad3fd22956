"""The one error hierarchy of specdec. Every message says what failed, the value seen, and a `Hint:`."""
from __future__ import annotations

import reprlib

SHOWN_CHARS = 40  # the most characters of a value someone else sent that a message repeats
_REPR = reprlib.Repr()  # reprlib cuts a container or a string before it writes it whole
_REPR.maxlevel, _REPR.maxstring, _REPR.maxlong, _REPR.maxother = 2, SHOWN_CHARS, SHOWN_CHARS, SHOWN_CHARS
_REPR.maxtuple = _REPR.maxlist = _REPR.maxarray = _REPR.maxdict = _REPR.maxset = _REPR.maxfrozenset = 3


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


class NumericError(BackendError):
    """A model's forward gave logits with no distribution in them: a NaN, or no finite largest logit (+inf, or all
    -inf). Its weights are damaged or were edited, or its values overflow. Every backend checks every logit of every
    forward, so no such row is ever turned into a token."""


def missing_dependency(module: str, extra: str) -> MissingDependencyError:
    """Build the error for an optional module that failed to import."""
    return MissingDependencyError(
        f"the optional dependency {module!r} is not installed",
        f"pip install 'specdec[{extra}]'",
    )


def nonfinite_logits(role: str, finite: list, positions: list, steps: int, last_only: bool) -> NumericError:
    """The error of a forward of rows at `positions` (each row's first; `steps` tokens a row) whose logits are not
    all sound: `finite` holds, for each row, a flag per position scored (`steps` of them, or the last alone where
    `last_only`): whether its logits are sound (no NaN, a finite largest logit)."""
    bad = [(row, t) for row, flags in enumerate(finite) for t, ok in enumerate(flags) if not ok]
    row, t = bad[0] if bad else (0, 0)
    at = positions[row] + (steps - 1 if last_only else t)
    more = f" ({len(bad)} of the call's {sum(map(len, finite))} positions)" if len(bad) > 1 else ""
    return NumericError(f"the {role}'s logits at position {at} of row {row} hold NaN or inf{more}",
                        "its weights are damaged or were edited (a hash recorded after the edit still passes): "
                        "re-export the bundle; backend='onnxruntime' runs the graph's own copy of them")


class Terminated(KeyboardInterrupt):
    """The process was asked to stop (SIGTERM); raised like Ctrl-C so that every `finally` and cleanup runs."""


def shown(value, limit: int = SHOWN_CHARS) -> str:
    """A short escaped prefix of a value a caller or a client sent, for a message: its repr cut to `limit` characters
    (a 900 KB string costs no more than a short one), escaped as `escaped` does, so neither a huge value nor markup
    comes back whole."""
    try:
        text = _REPR.repr(value)
    except Exception:  # noqa: BLE001 - a repr that fails (an int past Python's digit limit, a broken __repr__)
        text = f"(a {type(value).__name__} too long to show)"
    return escaped(text, limit)


def escaped(text: str, limit: int) -> str:
    """`text` cut to `limit` characters, its non-ASCII characters and HTML's <, > and & written as backslash escapes
    (a message that reaches a web page carries no markup)."""
    text = text[: limit * 10].encode("ascii", "backslashreplace").decode("ascii")
    for char in "<>&":
        text = text.replace(char, f"\\x{ord(char):02x}")
    return text if len(text) <= limit else text[: limit - 3] + "..."
