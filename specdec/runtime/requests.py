"""The request layer (docs/generation.md): how `Generator` and the serving engine turn a request into rows, in one place.

Each option a request brings is checked here once, with one message and one hint (GenerationConfig has checked
each option's own range already):
- the prompt: text (valid Unicode; through the chat template when asked, rendered by a prompt worker on its budget:
  specdec.runtime.prompt_worker), UTF-8 bytes, or token ids (integers, not bools or floats); at least one
  token; every id inside the target's vocabulary, the ids a text prompt's tokenizer gives included (a tokenizer.json
  that does not belong to the models gives ids they do not have); at most S tokens;
- the bundle's defaults: temperature, top_k and top_p a request leaves unset (None) take the manifest's defaults
  (`config`), so the library, `specdec generate` and the server decode one bundle alike; a value set is kept;
- γ: the request's own, else the bundle's, at most the bundle's γ_max (`serve --gamma` goes through the same check);
- the drafter: a kind this generator can run (`model` needs a draft model, `head` a draft head its target can feed).

Rows are built here: tokens, config, KV slot, drafter kind, the `auto` gate, the random stream row_rng(seed, row)
and the Gumbel noise key. A seeded sampled request gets a gate of its own (fixed bundle data) and a γ policy of its
own, so its tokens depend on nothing but the request: not on earlier requests, not on requests interleaved with
it, and not on its batch-mates in the server (the serving engine keeps its policy and runs its calls alone).
Refusals are OptionError / RequestCapacityError, whose `public` text a server sends instead of the message.
"""
from __future__ import annotations

import dataclasses
import numbers

import numpy as np

from specdec.chat_template import RenderLimitError
from specdec.errors import ConfigError, shown
from specdec.manifest import Manifest
from specdec.runtime import drafters as drafter_classes
from specdec.runtime.adaptive_gamma import GammaStart
from specdec.runtime.config import DRAFTER_KINDS, GenerationConfig, OptionError, RequestCapacityError
from specdec.runtime.drafters import ModelDrafter, ModelGate, PromptLookupDrafter
from specdec.runtime.head_drafter import HeadDrafter
from specdec.runtime.state import Finish, Row, row_rng
from specdec.runtime.text import TextCodec, holdback

DEFAULT_ALPHA, DEFAULT_COST = 0.7, 0.5  # priors of sampled requests where the bundle has no γ calibration
NO_TEMPLATE_HINT = "pass the prompt as raw text (chat=False; drop --chat; or POST it to /v1/completions)"


HEAD_PROBE = 8  # where the head's gate expects no gain, one greedy request in this many still weighs it (to learn)


class RequestLayer:
    """The request preparation of one generator: its bundle's manifest and tokenizer, whether it has a draft model,
    and its measured gate (which greedy requests share: their tokens do not depend on it)."""

    def __init__(self, manifest: Manifest, codec: TextCodec, gate: ModelGate, has_draft: bool, *, prompts,
                 head=None, head_problem: OptionError | None = None):
        self.manifest = manifest
        self.codec = codec
        self.gate = gate
        self.has_draft = has_draft
        self.prompts = prompts  # the PromptWorker that renders conversations on a budget
        self.head = head  # the bundle's draft head (specdec.head.model.HeadModel), or None
        self.head_problem = head_problem  # why its target cannot feed it (head_drafter.feature_problem), or None
        # the head's measured α and c on this machine, which `auto` weighs against the model's (greedy requests)
        self.head_gate = ModelGate() if head is not None and head_problem is None else None
        self.head_declined = 0  # greedy requests whose auto left the head out (head_gate_for)

    # --- the prompt ------------------------------------------------------------------------------------------
    def prompt_ids(self, prompt, chat: bool = False) -> list:
        """Checked token ids of a prompt: text (wrapped in the chat template when `chat`), UTF-8 bytes or token ids."""
        if isinstance(prompt, bytes):
            prompt = _utf8(prompt)
        if isinstance(prompt, str):
            if chat:
                return self.chat_ids([{"role": "user", "content": self.prompt_text(prompt, bound=False)}])
            return self.text_ids(self.codec.encode(self.prompt_text(prompt)))
        return self._checked(_token_ids(prompt), from_text=False)

    def prompt_text(self, prompt: str, bound: bool = True) -> str:
        """A text prompt, checked before it is tokenized: not empty, valid Unicode and (`bound`) no more bytes than S
        tokens can hold, so a prompt far too long is refused before it costs a tokenization."""
        if not prompt:
            raise OptionError("the prompt is empty", "pass at least one character or token", "the prompt is empty",
                              "prompt")
        size = _check_text(prompt, "the prompt", "prompt")
        if bound:
            self._check_bytes(size, "the prompt")
        return prompt

    def chat_ids(self, messages: list) -> list:
        """Checked token ids of a conversation ({"role", "content"} dicts) through the chat template, with the
        assistant's turn opened: rendered and tokenized by the prompt worker, on its budget (PromptBudgetError past
        it), at most the bytes S tokens can hold. An unsafe template raises ManifestError: the bundle's fault, not
        the request's."""
        self.check_messages(messages)
        try:
            ids = self.prompts.chat_ids(messages, self.max_text_bytes)
        except ConfigError as exc:
            raise self.render_refusal(exc) from None
        return self.text_ids(ids)

    def check_messages(self, messages: list) -> None:
        """What a conversation needs before it is rendered: a chat template, valid Unicode in every message."""
        if not self.codec.has_chat_template:
            raise OptionError("this bundle's tokenizer has no chat template, so a prompt cannot be wrapped as a chat "
                              "turn", NO_TEMPLATE_HINT, "this model has no chat template", "messages",
                              "no_chat_template")
        for message in messages:
            _check_text(message["content"], "a message", "messages")

    def render_refusal(self, exc: ConfigError) -> Exception:
        """A rendering's ConfigError as the request's refusal: too long for S, or the template refused (or failed
        on) this conversation."""
        if isinstance(exc, RenderLimitError):
            return self._too_long(f"the chat template's rendering of the messages grew past {exc.limit} bytes")
        if isinstance(exc, OptionError):
            return exc
        return OptionError(f"the chat template refused these messages ({exc.message})",
                           "check the roles and their order", "the chat template refused these messages", "messages")

    def text_ids(self, ids: list) -> list:
        """The ids a text (or a rendered conversation) tokenized to, checked."""
        return self._checked(ids, from_text=True)

    @property
    def max_text_bytes(self) -> int | None:
        """The most UTF-8 bytes a text prompt may have (more cannot fit S tokens); None where the tokenizer gives
        no bound (then the prompt is tokenized, and its tokens counted)."""
        return self.codec.max_text_bytes(self.manifest.target.max_seq_len)

    @property
    def root(self):
        """The bundle's directory, whose tokenizer files a prompt worker opens (the server's prompt workers too)."""
        return self.codec.root

    def room(self, prompt_len: int) -> int:
        """Tokens that S leaves after a prompt of `prompt_len` tokens (at least 1)."""
        return max(1, self.manifest.target.max_seq_len - prompt_len)

    def _check_bytes(self, size: int, what: str) -> None:
        bound = self.max_text_bytes
        if bound is not None and size > bound:
            raise self._too_long(f"{what} is {size} bytes of text; at most {bound} bytes can fit the bundle's "
                                 f"max_seq_len of {self.manifest.target.max_seq_len} tokens "
                                 f"({self.codec.token_bytes} bytes per token at most)")

    def _too_long(self, message: str) -> RequestCapacityError:
        size = self.manifest.target.max_seq_len
        return RequestCapacityError(message, "shorten the prompt or re-export with a larger --max-seq-len",
                                    f"the prompt is longer than this model's context of {size} tokens", "prompt")

    def _checked(self, ids: list, from_text: bool) -> list:
        if not ids:
            raise OptionError("the prompt has no token ids", "pass at least one token id", "the prompt is empty",
                              "prompt")
        vocab, size = self.manifest.target.dims.vocab_size, self.manifest.target.max_seq_len
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            where = "the tokenizer gave token id" if from_text else "token id"
            hint = ("this bundle's tokenizer files do not belong to its models: restore them or re-export the bundle"
                    if from_text else "check the tokenizer used")
            raise OptionError(f"{where} {bad}, outside the vocabulary 0..{vocab - 1}", hint,
                              f"a token id of the prompt is outside the vocabulary 0..{vocab - 1}", "prompt")
        if len(ids) > size:
            raise RequestCapacityError(f"the prompt has {len(ids)} tokens; the bundle's max_seq_len is {size}",
                                       "shorten the prompt or re-export with a larger --max-seq-len",
                                       f"the prompt is longer than this model's context of {size} tokens", "prompt")
        return ids

    # --- options: the bundle's defaults, γ, drafter, policy, gate ------------------------------------------------
    def config(self, config: GenerationConfig) -> GenerationConfig:
        """A request's effective options, checked against this bundle (check): with_defaults, then check. What the
        library, `specdec generate` and the server decode with."""
        config = self.with_defaults(config)
        self.check(config)
        return config

    def with_defaults(self, config: GenerationConfig) -> GenerationConfig:
        """`config` with each option it leaves unset (None) among temperature, top_k and top_p taken from the
        manifest's defaults; a value it sets is kept, whatever it is. γ stays as given: None lets the request's γ
        policy (or the server's controller) choose, starting from the bundle's γ (`gamma`); a number caps it."""
        defaults = self.manifest.defaults
        unset = {name: getattr(defaults, name) for name in config.unset}
        return dataclasses.replace(config, **unset) if unset else config

    def gamma(self, gamma: int | None) -> int:
        """γ of a request or of `serve --gamma` (None: the bundle's): the one check against the bundle's γ_max."""
        defaults = self.manifest.defaults
        chosen = defaults.gamma if gamma is None else gamma
        if chosen > defaults.gamma_max:
            raise OptionError(f"gamma {chosen} exceeds this bundle's gamma_max {defaults.gamma_max}",
                              f"pass gamma <= {defaults.gamma_max}, or re-export with a larger --gamma-max",
                              f"gamma exceeds this model's gamma_max {defaults.gamma_max}", "gamma")
        return chosen

    def check(self, config: GenerationConfig) -> None:
        """What a request's options need from this generator: γ <= γ_max, a drafter it can run."""
        self.gamma(config.gamma)
        if config.drafter_kind.needs_model and not self.has_draft:
            raise OptionError(f"drafter '{config.drafter}' needs a draft model, and this bundle has no draft model",
                              "use drafter 'prompt_lookup', 'auto' or 'none', or re-export with a draft",
                              "this model has no draft model", "drafter")
        if config.drafter_kind.needs_head:
            if self.head is None:
                raise OptionError(f"drafter '{config.drafter}' needs a trained draft head, and this bundle has none",
                                  "use drafter 'auto', 'model' or 'prompt_lookup', or give the bundle a head: specdec "
                                  "calibrate head BUNDLE --out OUT trains one, --from DIR attaches one (an EAGLE-3 "
                                  "checkpoint, or the head of another bundle of this model; docs/heads.md)",
                                  "this model has no draft head", "drafter")
            if self.head_problem is not None:
                raise self.head_problem

    @property
    def gamma_record(self):
        """The draft's γ calibration (a GammaRecord), or None."""
        draft = self.manifest.draft
        return draft.calibration.gamma if draft is not None else None

    def policy(self, config: GenerationConfig):
        """The γ policy of a request. Adaptive starts from the bundle's γ calibration; without one, greedy requests
        start from what the generator measured (its gate), sampled ones from fixed priors (seeds reproduce)."""
        config, alpha, cost = self.with_defaults(config), DEFAULT_ALPHA, DEFAULT_COST
        if config.greedy:
            alpha, cost = self.gate.alpha, self.gate.cost_ratio or DEFAULT_COST
        start = GammaStart(self.gamma(config.gamma), self.manifest.defaults.gamma_max, self.gamma_record, alpha, cost)
        return config.gamma_policy_kind.build(start)

    def own_policy(self, config: GenerationConfig):
        """The γ policy a request keeps to itself where others share an engine: a seeded sampled request's (its
        tokens depend on γ); None for the rest, whose γ the engine may choose."""
        return self.policy(config) if self.with_defaults(config).seeded_sample else None

    def gate_for(self, config: GenerationConfig) -> ModelGate:
        """The `auto` gate of a request: the measured one for greedy requests, a fixed one of its own otherwise."""
        if self.with_defaults(config).greedy:
            return self.gate
        record = self.gamma_record
        return ModelGate(cost_ratio=record.cost_ratio if record is not None else DEFAULT_COST)

    def head_gate_for(self, config: GenerationConfig) -> ModelGate | None:
        """The `auto` gate of a request's draft head: the measured one for greedy requests where the bundle has a head
        its target can feed, while it is learning or expects the head to pay at some γ; after that, for one request
        in HEAD_PROBE (to learn again); None otherwise (a sampled request's `auto` weighs the model alone: a fixed gate
        would need the head's cost as bundle data, which no calibration records yet). A row without one reads no
        hidden states: weighing the head costs their copy on every pass, and the head's catch-up where it drafts."""
        gate = self.head_gate
        if gate is None or not self.with_defaults(config).greedy:
            return None
        if gate.warming or max(gate.expected(g) for g in range(1, self.manifest.defaults.gamma_max + 1)) > 1.0:
            return gate
        self.head_declined += 1
        return gate if self.head_declined % HEAD_PROBE == 0 else None

    def eos_ids(self, config: GenerationConfig) -> tuple:
        given = config.eos_token_ids
        return tuple(given if given is not None else self.manifest.tokenizer.eos_token_ids)

    # --- rows and drafters ------------------------------------------------------------------------------------
    @property
    def max_rows(self) -> int:
        """Rows the backends hold at once: the target's max_batch, and the draft's where there is one."""
        target, draft = self.manifest.target, self.manifest.draft
        return min(target.max_batch, draft.max_batch) if draft is not None else target.max_batch

    def batch(self, max_batch: int | None) -> int:
        """Rows of `serve --max-batch` (None: every row the bundle holds): the one check against the bundle's."""
        rows = self.max_rows
        if max_batch is not None and max_batch > rows:
            raise ConfigError(f"max_batch={max_batch} exceeds this bundle's max_batch of {rows} rows",
                              f"pass --max-batch {rows} or less (the default: {rows}), or re-export the bundle with a "
                              "larger --max-batch")
        return rows if max_batch is None else max_batch

    def rows(self, prompts: list, config: GenerationConfig) -> list:
        """The rows of a request of one or more prompts, on slots 0..n-1, with its effective options (config)."""
        config = self.config(config)
        if not prompts:
            raise OptionError("the batch is empty", "pass at least one prompt", "the batch is empty", "prompt")
        if len(prompts) > self.max_rows:
            raise RequestCapacityError(f"batch of {len(prompts)} exceeds max_batch {self.max_rows}",
                                       "split the batch or re-export with a larger --max-batch",
                                       f"a batch holds at most {self.max_rows} prompts", "prompt")
        return [self.row(self.prompt_ids(prompt, config.chat), config, slot=index, index=index)
                for index, prompt in enumerate(prompts)]

    def row(self, ids: list, config: GenerationConfig, slot: int, index: int = 0) -> Row:
        """Row `index` of a request, on KV slot `slot`, with its options and the bundle's defaults (with_defaults);
        its random stream and noise come from (seed, index)."""
        config = self.with_defaults(config)
        return Row(tokens=list(ids), prompt_len=len(ids), rng=row_rng(config.seed, index), config=config, slot=slot,
                   gate=self.gate_for(config), head_gate=self.head_gate_for(config), noise_key=_noise_key(config, index),
                   drafter=config.drafter_kind)

    def drafters(self, draft, target) -> dict:
        """DrafterKind -> drafter for every kind that drafts here. `draft`: the draft backend as the caller times or
        meters it, or None; `target`: the target backend, whose KV a derived draft may copy."""
        lookup = PromptLookupDrafter()
        model = head = None
        if draft is not None:
            model = ModelDrafter(draft, self.manifest.defaults.max_prefill_chunk, self.gate.observe_draft_step,
                                 kv_source=target)
        if self.head_gate is not None:  # (a head its target cannot feed: requests for it are refused, auto leaves it)
            head = HeadDrafter(self.head, self.manifest.defaults.max_prefill_chunk, self.head_gate.observe_draft_step)
        built = {kind: kind.build(drafter_classes, lookup, model, head) for kind in DRAFTER_KINDS.values()}
        return {kind: drafter for kind, drafter in built.items() if drafter is not None}

    # --- text ----------------------------------------------------------------------------------------------------
    def text(self, row: Row) -> str:
        """The text of a row's generated tokens that may be shown: up to its stop string once it stopped; while it is
        active, without a tail that could still grow into a stop string or is an incomplete UTF-8 sequence. Each
        call's text starts with the previous call's, so streamed pieces add up to the final text."""
        text = self.codec.decode(row.tokens[row.prompt_len :])
        if row.finish == Finish.STOP:
            return text[: row.stop_at]
        if row.active:
            text = text.rstrip("\ufffd")  # an incomplete UTF-8 sequence: the next token may complete it
            text = text[: len(text) - holdback(text, row.config.stop)]
        return text


def _utf8(prompt: bytes) -> str:
    try:
        return prompt.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise OptionError(f"the prompt is not valid UTF-8 ({exc.reason} at byte {exc.start})",
                          "pass text, or bytes in UTF-8", "the prompt is not valid UTF-8", "prompt") from exc


def _check_text(text: str, what: str, option: str) -> int:
    """The UTF-8 bytes of `text`; OptionError where it holds a lone surrogate."""
    try:
        return len(text.encode("utf-8"))
    except UnicodeEncodeError as exc:
        raise OptionError(f"{what} holds {text[exc.start]!r} at {exc.start}, which is not valid Unicode text (a lone "
                          "surrogate)", "pass valid UTF-8 text", f"{what} is not valid Unicode text (a lone surrogate)",
                          option) from None


def _token_ids(prompt) -> list:
    """Token ids as Python ints: integers (numpy's too), never bools, floats or numeric strings."""
    try:
        ids = list(prompt)
    except TypeError:
        ids = None
    if ids is None or any(isinstance(t, bool) or not isinstance(t, numbers.Integral) for t in ids):
        raise OptionError(f"the prompt is neither text nor token ids ({type(prompt).__name__}: {shown(prompt)})",
                          "pass a string, a list of integer token ids, or a list of either (a batch)",
                          "the prompt is neither text nor token ids", "prompt")
    return [int(t) for t in ids]


def _noise_key(config: GenerationConfig, row: int) -> tuple | None:
    if config.greedy or not config.gumbel:
        return None
    seed = config.seed if config.seed is not None else int(np.random.SeedSequence().generate_state(1)[0])
    return (seed, row)
