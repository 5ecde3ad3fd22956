"""Tokenizer access for the runtime: the `tokenizers` library and a sandboxed jinja2 chat template, no transformers."""
from __future__ import annotations

import json
import os
from pathlib import Path

from specdec.errors import ConfigError, ManifestError, missing_dependency
from specdec.files import read_regular
from specdec.runtime.state import Finish


class TextCodec:
    def __init__(self, root: Path):
        self.root = Path(root)
        self.tokenizer = None
        self.template = None
        self.template_text = None
        self.special = {}
        self.token_bytes = None  # the most bytes of text one token stands for (None: not bounded, see below)

    @staticmethod
    def files_read(root: Path) -> list:
        """The bundle files open() reads: tokenizer.json, and tokenizer_config.json and chat_template.jinja where
        present."""
        return ["tokenizer.json"] + [name for name in ("tokenizer_config.json", "chat_template.jinja")
                                     if os.path.exists(Path(root) / name)]  # present in any form: read, checked

    def open(self) -> "TextCodec":
        try:
            from tokenizers import Tokenizer
        except ImportError as exc:
            raise missing_dependency("tokenizers", "cpu") from exc
        path = self.root / "tokenizer.json"
        try:
            text = read_regular(path).decode("utf-8")  # never a FIFO or a device
        except FileNotFoundError:
            raise ManifestError(f"{path} is missing", "re-export the bundle") from None
        except OSError as exc:  # an error reading it
            raise ManifestError(f"{path} cannot be read: {exc.strerror}", "re-export the bundle (or copy it "
                                "again)") from None
        except UnicodeDecodeError:
            raise ManifestError(f"{path} is not UTF-8 text", "the file is truncated or corrupt; re-export the bundle "
                                "(or copy it again)") from None
        try:
            self.tokenizer = Tokenizer.from_str(text)
        except Exception as exc:  # noqa: BLE001 - tokenizers raises a plain Exception for a damaged file
            raise ManifestError(f"{path} cannot be read ({str(exc).splitlines()[0] if str(exc) else type(exc).__name__})",
                                "the file is truncated or corrupt; re-export the bundle (or copy it again)") from None
        from specdec.chat_template import compile_chat_template, read_chat_template

        template, self.special = read_chat_template(self.root)
        if template is not None:
            self.template = compile_chat_template(template)  # in jinja2's sandbox: a bundle carries no code
            self.template_text = template
        self.token_bytes = token_bytes(self.tokenizer)
        return self

    def max_text_bytes(self, tokens: int) -> int | None:
        """A bound on the UTF-8 bytes of a text that encodes to at most `tokens` tokens (a longer text cannot fit, and
        is refused before it is tokenized); None where this tokenizer's text has no such bound."""
        return None if self.token_bytes is None else tokens * self.token_bytes

    def encode(self, text: str, special: bool = True) -> list:
        return self.tokenizer.encode(text, add_special_tokens=special).ids

    def decode(self, ids: list) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    @property
    def has_chat_template(self) -> bool:
        return self.template is not None

    def render_chat(self, messages: list, max_bytes: int | None = None) -> str:
        """The text of `messages` with the assistant's turn opened, rendered in the sandbox, at most `max_bytes` of
        UTF-8 (see specdec.chat_template.render_chat for the errors). Unbounded in time and memory: callers render
        in a prompt worker (specdec.runtime.prompt_worker), which calls this."""
        from specdec.chat_template import RENDER_MAX_BYTES, render_chat

        return render_chat(self.template, messages, self.special, max_bytes=max_bytes or RENDER_MAX_BYTES)


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


# Normalizers that never shrink text by more than a factor (Unicode composition joins at most 3 code points, of 3
# bytes each, into one of 3 bytes; Prepend only adds); anything else (Replace, Strip, Lowercase ...) is unbounded.
SEQUENCE = "Sequence"  # a tokenizer.json normalizer or pre-tokenizer that chains others
_NORMALIZER_SHRINK = {"NFC": 3, "NFKC": 3, "NFD": 1, "NFKD": 1, "Prepend": 1}
_PRE_TOKENIZERS = {"ByteLevel", "Metaspace", "Digits", "Punctuation", "Split"}  # they split; none drops text ...


def token_bytes(tokenizer) -> int | None:
    """The most UTF-8 bytes of input text one token of `tokenizer` stands for, times the most its normalizer can
    shrink text; None unless the tokenizer is a BPE model that keeps every byte of the text (normalizers and
    pre-tokenizers that drop or merge text, and unknown tokens fused over several characters, have no bound)."""
    spec = json.loads(tokenizer.to_str())
    model, shrink = spec.get("model") or {}, _shrink(spec.get("normalizer"))
    if model.get("type") != "BPE" or (model.get("fuse_unk") and model.get("unk_token")) or shrink is None:
        return None
    if not _keeps_text(spec.get("pre_tokenizer")):
        return None
    byte_level = _is_byte_level(spec.get("pre_tokenizer"))  # a token's characters are its bytes, one each
    added = {token["content"] for token in spec.get("added_tokens") or ()}
    longest = max((len(text) if byte_level and text not in added else len(text.encode("utf-8"))
                   for text in tokenizer.get_vocab(with_added_tokens=True)), default=0)
    return max(1, longest) * shrink


def _shrink(normalizer) -> int | None:
    if normalizer is None:
        return 1
    kind = normalizer.get("type")
    if kind == SEQUENCE:
        factor = 1
        for part in normalizer.get("normalizers") or ():
            part_factor = _shrink(part)
            if part_factor is None:
                return None
            factor *= part_factor
        return factor
    return _NORMALIZER_SHRINK.get(kind)


def _keeps_text(pre_tokenizer) -> bool:
    if pre_tokenizer is None:
        return True
    kind = pre_tokenizer.get("type")
    if kind == SEQUENCE:
        return all(_keeps_text(part) for part in pre_tokenizer.get("pretokenizers") or ())
    return kind in _PRE_TOKENIZERS and pre_tokenizer.get("behavior") != "Removed"  # ... but Split can


def _is_byte_level(pre_tokenizer) -> bool:
    if pre_tokenizer is None:
        return False
    if pre_tokenizer.get("type") == "Sequence":
        return any(_is_byte_level(part) for part in pre_tokenizer.get("pretokenizers") or ())
    return pre_tokenizer.get("type") == "ByteLevel"
