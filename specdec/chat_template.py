"""Chat templates are data from a bundle or a model folder, never code: they render in jinja2's immutable sandbox.

The environment follows what transformers gives a chat template (trim_blocks, lstrip_blocks, loop controls, the
`generation` tag, `raise_exception`, `strftime_now`, a `tojson` that does not escape HTML), plus the
`keep_trailing_newline` the runtime has always rendered with. Inside the sandbox a template reaches no Python
internals (no dunder attributes, no mutation of the values passed in); an attempt raises ManifestError.
Depends on jinja2 only (a base dependency), so the runtime and export share it.
"""
from __future__ import annotations

import json
import os
from datetime import datetime
from pathlib import Path

from specdec.errors import ConfigError, ManifestError, MissingDependencyError
from specdec.files import read_regular

SAFE_JINJA = (3, 1, 6)  # older releases have known sandbox escapes
SAMPLE_CONVERSATION = [{"role": "user", "content": "Hello!"}]
RENDER_MAX_BYTES = 8 << 20  # a rendering stops past this many bytes of UTF-8 where the caller states no bound
_UNSAFE_HINT = ("the template is not a plain chat template; re-export from a model whose chat template renders in "
                "jinja2's sandbox (as transformers renders it)")


def _jinja():
    import jinja2
    import jinja2.ext
    import jinja2.sandbox

    found = tuple(int(part) for part in jinja2.__version__.split(".")[:3] if part.isdigit())
    if found < SAFE_JINJA:
        raise MissingDependencyError(f"jinja2 {jinja2.__version__} has known sandbox escapes; chat templates need "
                                     f">= {'.'.join(map(str, SAFE_JINJA))}", "pip install -U 'jinja2>=3.1.6'")
    return jinja2


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(pattern: str) -> str:
    return datetime.now().strftime(pattern)


def _environment():
    """The sandboxed environment chat templates compile in."""
    jinja2 = _jinja()

    def raise_exception(message):
        raise jinja2.TemplateError(message)

    class Generation(jinja2.ext.Extension):
        """`{% generation %}...{% endgeneration %}` renders its body (transformers marks assistant text with it)."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    class Namespace(jinja2.utils.Namespace):
        """A namespace that stores no underscore names (a way into Python internals)."""

        def __setitem__(self, name, value):
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.sandbox.SecurityError(f"a chat template may not set {name!r} on a namespace")
            super().__setitem__(name, value)

    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, keep_trailing_newline=True,
        extensions=[Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=raise_exception, strftime_now=_strftime_now, namespace=Namespace)
    return env


def compile_chat_template(text: str):
    """A jinja2 Template compiled in the sandbox; ManifestError for a template jinja2 cannot parse."""
    jinja2 = _jinja()
    if not isinstance(text, str):
        raise ManifestError(f"the chat template is a {type(text).__name__}, not text",
                            "write the template as a string in chat_template.jinja or tokenizer_config.json")
    try:
        return _environment().from_string(text)
    except jinja2.TemplateSyntaxError as exc:
        raise ManifestError(f"the chat template does not parse: {exc.message} (line {exc.lineno})",
                            "fix or remove the chat template; without one, prompts are raw text") from exc


class RenderLimitError(ConfigError):
    """A rendering grew past its bound of bytes (the template's output, not its input, is what is bounded)."""

    def __init__(self, limit: int):
        super().__init__(f"the chat template's output grew past {limit} bytes of UTF-8",
                         "shorten the conversation; if it is short, the bundle's chat template writes too much")
        self.limit = limit


class TemplateRefusal(ConfigError):
    """The template refused the conversation or failed on it (render_chat's ConfigError, as a prompt worker saw it)."""


def render_chat(template, messages: list, special: dict, add_generation_prompt: bool = True,
                max_bytes: int = RENDER_MAX_BYTES) -> str:
    """The text of `messages` as the template writes it, stopped with RenderLimitError once its UTF-8 passes
    `max_bytes` (the one check of a rendering's size; a template that writes without end never holds the whole of it).
    ManifestError if the template attempts something the sandbox refuses; ConfigError if it refuses the conversation
    (raise_exception) or fails on it. Time and memory are not bounded here: the library and the server render in
    worker processes that are (specdec.runtime.prompt_worker)."""
    jinja2 = _jinja()
    try:
        parts, size = [], 0
        for part in template.generate(messages=messages, add_generation_prompt=add_generation_prompt, **special):
            if size + len(part) > max_bytes:  # a character is a byte or more: no need to encode a part this long
                raise RenderLimitError(max_bytes)
            size += len(part.encode("utf-8", "surrogatepass"))
            if size > max_bytes:
                raise RenderLimitError(max_bytes)
            parts.append(part)
        return "".join(parts)
    except RenderLimitError:
        raise
    except jinja2.sandbox.SecurityError as exc:
        raise ManifestError(f"the chat template attempted an unsafe operation, refused by the sandbox ({exc})",
                            _UNSAFE_HINT) from None
    except jinja2.UndefinedError as exc:
        raise ConfigError(f"the chat template failed on the conversation ({exc.message})",
                          "check the messages; the template expects another form") from None
    except jinja2.TemplateError as exc:  # raise_exception(...) in the template
        raise ConfigError(f"the chat template refused the conversation: {exc.message or type(exc).__name__}",
                          "check the roles and their order (most templates want user/assistant turns)") from None
    except (TypeError, ValueError, LookupError, AttributeError, ArithmeticError, RecursionError) as exc:
        raise ConfigError(f"the chat template failed on the conversation ({type(exc).__name__}: {exc})",
                          "check the messages; the template expects another form") from None


def read_chat_template(root: str | Path) -> tuple[str | None, dict]:
    """(template text or None, special tokens such as bos_token) of a tokenizer folder, as the runtime reads
    them: tokenizer_config.json's chat_template, else chat_template.jinja."""
    root = Path(root)
    config_path = root / "tokenizer_config.json"
    try:  # read where present in any form: a FIFO or a device is refused (specdec.files), never read
        config = json.loads(read_regular(config_path).decode("utf-8")) if os.path.exists(config_path) else {}
    except (ValueError, RecursionError) as exc:
        raise ManifestError(f"{config_path} is not valid UTF-8 JSON ({type(exc).__name__})",
                            "re-export the bundle") from None
    if not isinstance(config, dict):
        raise ManifestError(f"{config_path} is not a JSON object", "re-export the bundle")
    special = {k: v for k, v in config.items() if k.endswith("_token") and isinstance(v, str)}
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": "default", "template": "..."}, ...]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    jinja_path = root / "chat_template.jinja"
    if template is None and os.path.exists(jinja_path):
        try:
            template = read_regular(jinja_path).decode("utf-8")
        except UnicodeDecodeError:
            raise ManifestError(f"{jinja_path} is not UTF-8 text", "re-export the bundle") from None
    return template or None, special


def check_chat_template(text: str, special: dict) -> None:
    """Compile a chat template in the sandbox and render a sample conversation with it; raises ManifestError or
    ConfigError (see render_chat)."""
    render_chat(compile_chat_template(text), SAMPLE_CONVERSATION, special)
