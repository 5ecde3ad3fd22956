"""Tokenizer access for the runtime: the `tokenizers` library and a jinja2 chat template, no transformers."""
from __future__ import annotations

import json
from pathlib import Path

from specdec.errors import ConfigError, ManifestError, missing_dependency


class TextCodec:
    def __init__(self, root: Path):
        self.root = Path(root)
        self.tokenizer = None
        self.template = None
        self.special = {}

    def open(self) -> "TextCodec":
        try:
            from tokenizers import Tokenizer
        except ImportError as exc:
            raise missing_dependency("tokenizers", "cpu") from exc
        path = self.root / "tokenizer.json"
        if not path.is_file():
            raise ManifestError(f"{path} is missing", "re-export the bundle")
        self.tokenizer = Tokenizer.from_file(str(path))
        config_path = self.root / "tokenizer_config.json"
        config = json.loads(config_path.read_text(encoding="utf-8")) if config_path.is_file() else {}
        self.special = {k: v for k, v in config.items() if k.endswith("_token") and isinstance(v, str)}
        template = config.get("chat_template")
        jinja_path = self.root / "chat_template.jinja"
        if template is None and jinja_path.is_file():
            template = jinja_path.read_text(encoding="utf-8")
        if template:
            import jinja2

            env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True, keep_trailing_newline=True)
            self.template = env.from_string(template)
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
        rendered = self.template.render(
            messages=[{"role": "user", "content": text}], add_generation_prompt=True, **self.special
        )
        return self.encode(rendered, special=False)


class StopStrings:
    """Stop strings, found in the detokenized text of a row's generated tokens (checked where EOS is)."""

    def __init__(self, codec: TextCodec):
        self.codec = codec

    def apply(self, row, since: int = 0) -> None:
        """If the row's text contains one of its stop strings, keep the shortest prefix of tokens whose text does,
        set finish = "stop" and stop_at = where the earliest stop string begins in that text. `since`: generated
        tokens whose text was already checked (it held no stop string)."""
        stops = row.config.stop
        generated = row.tokens[row.prompt_len :]
        if not _first_stop(self.codec.decode(generated), stops)[1]:
            return
        for end in range(max(1, since + 1), len(generated) + 1):
            at, found = _first_stop(self.codec.decode(generated[:end]), stops)
            if found:
                del row.tokens[row.prompt_len + end :]
                row.finish, row.stop_at = "stop", at
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
