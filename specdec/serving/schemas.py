"""Request and response bodies of the OpenAI API subset specdec serves (pydantic models mirroring its schema).

specdec's own options travel in the extension object `specdec` ({"drafter": ..., "gamma": ...}); with the
`openai` client: `extra_body={"specdec": {"drafter": "model", "gamma": 4}}`. Fields the API defines but specdec
does not implement are refused with a 400 when set to anything but their no-op value (the error names the field,
never the value sent: specdec.serving.web). Options that reach a
GenerationConfig or the request layer as they are (temperature, top_p, top_k, γ, stop strings, the prompt) are
checked there, once, not here.
"""
from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from specdec.runtime.config import DRAFTERS

MAX_STOPS = 4  # as OpenAI
# OpenAI fields specdec does not implement, with the values that ask for nothing (anything else is refused by name)
UNSUPPORTED = {"echo": (False, None), "best_of": (1, None), "suffix": (None, ""), "logit_bias": (None, {}),
               "top_logprobs": (None, 0), "tools": (None, []), "tool_choice": (None, "none"), "functions": (None, []),
               "function_call": (None, "none"), "parallel_tool_calls": (None,), "audio": (None,),
               "modalities": (None, ["text"]), "prediction": (None,), "response_format": (None, {"type": "text"})}


class SpecdecOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    drafter: Literal[DRAFTERS] | None = None  # auto, model, prompt_lookup, none
    gamma: int | None = None  # the most drafts per round for this request
    top_k: int | None = None  # None: the bundle's default; 0: off


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Sampling(BaseModel):
    """Fields shared by both endpoints."""

    model_config = ConfigDict(extra="ignore")

    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = None  # None: the bundle's default (like top_p)
    top_p: float | None = None
    n: int = 1
    seed: int | None = Field(None, strict=True)  # an integer: not a boolean, not a numeric string
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    logprobs: bool | int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    specdec: SpecdecOptions | None = None

    # the fields of UNSUPPORTED: accepted at their no-op values only
    echo: Any = None
    best_of: Any = None
    suffix: Any = None
    logit_bias: Any = None
    top_logprobs: Any = None
    tools: Any = None
    tool_choice: Any = None
    functions: Any = None
    function_call: Any = None
    parallel_tool_calls: Any = None
    audio: Any = None
    modalities: Any = None
    prediction: Any = None
    response_format: Any = None

    @field_validator(*UNSUPPORTED)
    @classmethod
    def _unsupported(cls, value, info):
        if not any(value == no_op and type(value) is type(no_op) for no_op in UNSUPPORTED[info.field_name]):
            raise ValueError("not supported by this server; leave it out")  # never the value: a client's echo
        return value

    @field_validator("n")
    @classmethod
    def _one_choice(cls, n: int) -> int:
        if n != 1:
            raise ValueError("only n = 1 is supported; send n requests instead")
        return n

    @field_validator("stop")
    @classmethod
    def _stops(cls, stop):
        stops = [stop] if isinstance(stop, str) else list(stop or [])
        if len(stops) > MAX_STOPS:
            raise ValueError(f"give at most {MAX_STOPS} stop strings")
        return stops

    @field_validator("logprobs")
    @classmethod
    def _no_logprobs(cls, value):
        if value:
            raise ValueError("logprobs are not supported")
        return value

    @field_validator("presence_penalty", "frequency_penalty")
    @classmethod
    def _no_penalties(cls, value: float) -> float:
        if value != 0:
            raise ValueError("penalties are not supported (they would change the target's distribution)")
        return value

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(_Sampling):
    prompt: str | list[int] | list[str] | list[list[int]]

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, prompt):
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise ValueError("only one prompt per request is supported; send one request per prompt")
            prompt = prompt[0]
        return prompt  # an empty one is refused where every prompt is checked (specdec.runtime.requests)


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None

    @property
    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)


REQUEST_MODELS = (CompletionRequest, ChatCompletionRequest, ChatMessage, TextPart, SpecdecOptions, StreamOptions)


# --- responses ------------------------------------------------------------------------------------------------
def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def now() -> int:
    return int(time.time())


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: None = None
    finish_reason: str | None = None


class Completion(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    logprobs: None = None
    finish_reason: str


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class Delta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: Delta
    logprobs: None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "specdec"


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorDetail
