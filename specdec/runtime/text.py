"""Tokenizer access for the runtime: the `tokenizers` library and a sandboxed jinja2 chat template, no transformers."""
from __future__ import annotations

from pathlib import Path

from specdec.errors import ConfigError, ManifestError, missing_dependency
from specdec.runtime.state import Finish


class TextCodec:
    def __init__(self, root: Path):
        self.root = Path(root)
        self.tokenizer = None
        self.template = None
        self.special = {}

    @staticmethod
    def files_read(root: Path) -> list:
        """The bundle files open() reads: tokenizer.json, and tokenizer_config.json and chat_template.jinja where
        present."""
        return ["tokenizer.json"] + [name for name in ("tokenizer_config.json", "chat_template.jinja")
                                     if (Path(root) / name).is_file()]

    def open(self) -> "TextCodec":
        try:
            from tokenizers import Tokenizer
        except ImportError as exc:
            raise missing_dependency("tokenizers", "cpu") from exc
        path = self.root / "tokenizer.json"
        if not path.is_file():
            raise ManifestError(f"{path} is missing", "re-export the bundle")
        try:
            self.tokenizer = Tokenizer.from_file(str(path))
        except Exception as exc:  # noqa: BLE001 - tokenizers raises a plain Exception for a damaged file
            raise ManifestError(f"{path} cannot be read ({str(exc).splitlines()[0] if str(exc) else type(exc).__name__})",
                                "the file is truncated or corrupt; re-export the bundle (or copy it again)") from None
        from specdec.chat_template import compile_chat_template, read_chat_template

        template, self.special = read_chat_template(self.root)
        if template is not None:
            self.template = compile_chat_template(template)  # in jinja2's sandbox: a bundle carries no code
        return self

    def encode(self, text: str, special: bool = True) -> list:
        return self.tokenizer.encode(text, add_special_tokens=special).ids

    def decode(self, ids: list) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    @property
    def has_chat_template(self) -> bool:
        return self.template is not None

    def chat(self, text: str) -> list:
        """Token ids of `text` as one user turn, with the assistant's turn opened."""
        if self.template is None:
            raise ConfigError("this bundle's tokenizer has no chat template, so a prompt cannot be wrapped as a chat turn",
                              "pass the prompt as raw text (chat=False; drop --chat)")
        return self.encode(self.render_chat([{"role": "user", "content": text}]), special=False)

    def render_chat(self, messages: list) -> str:
        """The text of `messages` with the assistant's turn opened, rendered in the sandbox (see
        specdec.chat_template.render_chat for the errors)."""
        from specdec.chat_template import render_chat

        return render_chat(self.template, messages, self.special)


class StopStrings:
    """Stop strings, found in the detokenized text of a row's generated tokens (checked where EOS is)."""

    def __init__(self, codec: TextCodec):
        self.codec = codec

    def apply(self, row, since: int = 0) -> None:
        """If the row's text contains one of its stop strings, keep the shortest prefix of tokens whose text does,
        set finish = Finish.STOP and stop_at = where the earliest stop string begins in that text. `since`: generated
        tokens whose text was already checked (it held no stop string)."""
        stops = row.config.stop
        generated = row.tokens[row.prompt_len :]
        if not _first_stop(self.codec.decode(generated), stops)[1]:
            return
        for end in range(max(1, since + 1), len(generated) + 1):
            at, found = _first_stop(self.codec.decode(generated[:end]), stops)
            if found:
                del row.tokens[row.prompt_len + end :]
                row.finish, row.stop_at = Finish.STOP, at
                return


def _first_stop(text: str, stops: tuple) -> tuple[int, bool]:
    hits = [text.find(s) for s in stops if s in text]
    return (min(hits), True) if hits else (len(text), False)


def holdback(text: str, stops: tuple) -> int:
    """Characters at the end of `text` that could still grow into a stop string: a stream must not show them yet."""
    longest = 0
    for stop in stops:
        for size in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:size]):
                longest = size
                break
    return longest
