"""The prompts a head is trained on: the target answers them (specdec.calibration.head_train.data), and its answers
are the training text. Made from the templates and word lists of `words` and from text that ships with Python
itself (the standard library's docstrings and small pure-Python functions, read with `ast`, never imported), and
from the calibration paragraphs of specdec.calibration.builtin_texts. Never from benchmarks/prompts/ (a test checks).

A prompt is (text, chat): chat prompts go through the bundle's chat template; the others (code to complete, text
to continue) are fed raw, as the benchmark suite's code prompts are. An `asked` prompt has no text yet: the target
writes the user's request itself (head_train.asked), a share of them as --asked-share says.
"""
from __future__ import annotations

import ast
import random
import re
import sysconfig
from dataclasses import dataclass
from enum import StrEnum
from functools import lru_cache
from pathlib import Path

from specdec.calibration.builtin_texts import TEXTS
from specdec.calibration.head_train import words as w

# pure-Python standard library modules whose docstrings and small functions become prompts
STDLIB = ("argparse", "base64", "bisect", "calendar", "colorsys", "csv", "dataclasses", "difflib", "fnmatch",
          "fractions", "ftplib", "getopt", "gettext", "glob", "gzip", "heapq", "html/__init__", "imaplib",
          "ipaddress", "json/__init__", "logging/__init__", "mailbox", "mimetypes", "netrc", "numbers", "pathlib",
          "pprint", "queue", "quopri", "random", "sched", "secrets", "shlex", "shutil", "smtplib", "statistics",
          "string", "tarfile", "textwrap", "threading", "timeit", "tokenize", "uuid", "wave", "webbrowser",
          "zipfile")
MAX_FUNCTION_LINES = 16


class PromptKind(StrEnum):
    CHAT = "chat"  # questions and requests (words.CHAT_TEMPLATES)
    WRITING = "writing"  # stories, poems, messages
    CODE = "code_request"  # code to write, explain or fix (a chat turn)
    COMPLETION = "completion"  # a signature and docstring to complete (raw)
    TEXT = "text"  # summarise, rewrite, translate a paragraph
    CONTINUE = "continue"  # a paragraph's first sentence to continue (raw)


WEIGHTS = {PromptKind.CHAT: 6, PromptKind.WRITING: 4, PromptKind.CODE: 3, PromptKind.COMPLETION: 2,
           PromptKind.TEXT: 5, PromptKind.CONTINUE: 1}  # how often each kind is drawn


@dataclass(frozen=True)
class Prompt:
    text: str
    chat: bool
    asked: bool = False  # the target writes the request (text is empty until then)


ASKED = Prompt("", chat=True, asked=True)


@dataclass(frozen=True)
class Harvest:
    """Text read from the standard library: paragraphs, small functions' sources, (signature, first docstring
    line) pairs."""

    paragraphs: tuple
    functions: tuple
    signatures: tuple
    sentences: tuple  # of the paragraphs, TEXTS' included


def _paragraphs(docstring: str) -> list:
    return [" ".join(p.split()) for p in docstring.split("\n\n") if 200 <= len(" ".join(p.split())) <= 900
            and not re.search(r"[>]{3}|::|\.\. ", p)]


def _from_module(path: Path) -> tuple[list, list, list]:
    source = path.read_text(encoding="utf-8")
    tree, lines = ast.parse(source), source.splitlines()
    paragraphs = _paragraphs(ast.get_docstring(tree) or "")
    functions, signatures = [], []
    for node in tree.body:  # module-level functions (methods would need their class)
        if not isinstance(node, ast.FunctionDef) or node.name.startswith("_"):
            continue
        doc = ast.get_docstring(node)
        if doc:
            paragraphs += _paragraphs(doc)
            first = doc.strip().splitlines()[0].strip()
            if 20 <= len(first) <= 120 and not node.decorator_list:
                signatures.append((f"def {node.name}({ast.unparse(node.args)}):", first))
        if 4 <= node.end_lineno - node.lineno + 1 <= MAX_FUNCTION_LINES:
            functions.append("\n".join(lines[node.lineno - 1 : node.end_lineno]))
    return paragraphs, functions, signatures


@lru_cache(maxsize=1)
def stdlib_harvest() -> Harvest:
    """What STDLIB's modules give (those missing or unreadable here skipped)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    paragraphs, functions, signatures = [], [], []
    for name in STDLIB:
        try:
            found = _from_module(root / f"{name}.py")
        except (OSError, SyntaxError, UnicodeDecodeError):
            continue
        paragraphs += found[0]
        functions += found[1]
        signatures += found[2]
    paragraphs = tuple(dict.fromkeys(paragraphs))
    return Harvest(paragraphs, tuple(dict.fromkeys(functions)), tuple(dict.fromkeys(signatures)),
                   tuple(_sentences(TEXTS + paragraphs)))


def _sentences(paragraphs) -> list:
    return [s for p in paragraphs for s in re.split(r"(?<=[.!?])\s+", p) if 40 <= len(s) <= 200
            and len(s.splitlines()) == 1]


def _broken(sentence: str, rng: random.Random) -> str:
    """The sentence with a few everyday mistakes."""
    swaps = [(" their ", " there "), (" is ", " are "), ("'", ""), (" the ", " teh "), (" to ", " too "),
             (" its ", " it's "), (",", "")]
    for old, new in rng.sample(swaps, 3):
        sentence = sentence.replace(old, new, 1)
    return sentence[0].lower() + sentence[1:]


def _fields(rng: random.Random, harvest: Harvest) -> dict:
    """A value for every placeholder the templates use."""
    a, b = rng.choice(w.PAIRS)
    recipient, subject = rng.choice(w.RECIPIENTS)
    name, args, returns, doc = rng.choice(w.CODE_TASKS)
    paragraphs = TEXTS + harvest.paragraphs
    sentence = rng.choice(harvest.sentences or TEXTS)
    character, character2 = rng.sample(w.CHARACTERS, 2)
    return {"concept": rng.choice(w.CONCEPTS), "a": a, "b": b, "activity": rng.choice(w.ACTIVITIES),
            "howto": rng.choice(w.HOWTOS), "n": rng.choice(w.COUNTS), "audience": rng.choice(w.AUDIENCES),
            "character": character, "character2": character2, "event": rng.choice(w.EVENTS),
            "place": rng.choice(w.PLACES), "poem": rng.choice(w.POEM_TOPICS), "recipient": recipient,
            "subject": subject, "product": rng.choice(w.PRODUCTS), "tone": rng.choice(w.TONES),
            "language": rng.choice(w.LANGUAGES), "spoken": rng.choice(w.SPOKEN), "doc": doc,
            "lower": doc[0].lower() + doc[1:], "lower_verb": doc[0].lower() + doc[1:].rstrip("."),
            "source": rng.choice(harvest.functions) if harvest.functions else f"def {name}({args}) -> {returns}: ...",
            "paragraph": rng.choice(paragraphs), "sentence": sentence, "broken": _broken(sentence, rng),
            "task": (name, args, returns, doc)}


def _completion(rng: random.Random, harvest: Harvest, fields: dict) -> str:
    """Code for the target to complete: a signature and its docstring."""
    if harvest.signatures and rng.random() < 0.5:
        signature, doc = rng.choice(harvest.signatures)
        return f'{signature}\n    """{doc}"""\n'
    name, args, returns, doc = fields["task"]
    return f'def {name}({args}) -> {returns}:\n    """{doc}"""\n'


TEMPLATES = {PromptKind.CHAT: w.CHAT_TEMPLATES, PromptKind.WRITING: w.WRITING_TEMPLATES,
             PromptKind.CODE: w.CODE_TEMPLATES, PromptKind.TEXT: w.TEXT_TEMPLATES}


def one_prompt(rng: random.Random, harvest: Harvest) -> Prompt:
    kind = rng.choices(list(WEIGHTS), weights=list(WEIGHTS.values()))[0]
    fields = _fields(rng, harvest)
    if kind is PromptKind.COMPLETION:
        return Prompt(_completion(rng, harvest, fields), chat=False)
    if kind is PromptKind.CONTINUE:
        first = re.split(r"(?<=[.!?])\s+", fields["paragraph"])[0]
        return Prompt(first, chat=False)
    return Prompt(rng.choice(TEMPLATES[kind]).format(**fields), chat=True)


def training_prompts(count: int, seed: int = 0, asked_share: float = 0.0) -> list:
    """`count` prompts, the same for the same seed (on the same Python: its docstrings are text here): about
    `asked_share` of them ASKED (the target writes them), the others distinct templated ones (with asked_share 0,
    the very prompts of a run before asked ones existed)."""
    rng, harvest, seen, prompts = random.Random(seed), stdlib_harvest(), set(), []
    asking = random.Random(f"asked {seed}")  # a stream of its own: the templated prompts stay those of the seed
    attempts = 0
    while len(prompts) < count and attempts < 50 * count:
        if asked_share and asking.random() < asked_share:
            prompts.append(ASKED)
            continue
        prompt = one_prompt(rng, harvest)
        attempts += 1
        if prompt.text not in seen:
            seen.add(prompt.text)
            prompts.append(prompt)
    return prompts
