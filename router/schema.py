"""Client request validation: typed views of the OpenAI fields the router checks.

The raw JSON object is kept and forwarded untouched (engines may support fields the router
has never heard of); the msgspec structs below only validate the fields the router itself
relies on, and ignore the rest. Validation failures raise `InvalidRequest` with `param` set
to the offending field.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal, TypeVar

import msgspec
from msgspec import Meta

from router.errors import InvalidRequest

__all__ = [
    "ChatParams",
    "ClientRequest",
    "CompletionParams",
    "classify_prompt",
    "parse_chat",
    "parse_completion",
]

PositiveInt = Annotated[int, Meta(ge=1)]
Temperature = Annotated[float, Meta(ge=0.0, le=2.0)]
TopP = Annotated[float, Meta(gt=0.0, le=1.0)]


class StreamOptions(msgspec.Struct, kw_only=True):
    include_usage: bool | None = None
    continuous_usage_stats: bool | None = None


class _Common(msgspec.Struct, kw_only=True):
    model: str | None = None
    max_tokens: PositiveInt | None = None
    max_completion_tokens: PositiveInt | None = None
    n: PositiveInt | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None


class CompletionParams(_Common, kw_only=True):
    """`/v1/completions` fields the router validates."""

    prompt: str | list[Any]


class Message(msgspec.Struct, kw_only=True):
    role: str
    content: str | list[Any] | None = None


class ChatParams(_Common, kw_only=True):
    """`/v1/chat/completions` fields the router validates."""

    messages: Annotated[list[Message], Meta(min_length=1)]
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None


@dataclass(slots=True)
class ClientRequest:
    """One validated client request as the orchestrator sees it.

    `body` is the client's JSON object (forwarded as is, apart from the leg rewrites);
    `prompt` is the single prompt to tokenize (str or token ids), None for chat and batch;
    `batch` is True for list prompts with several entries (never disaggregated).
    """

    kind: Literal["completion", "chat"]
    path: str
    body: dict[str, Any]
    params: CompletionParams | ChatParams
    request_id: str  # the router's internal id: the engines' key (router/request_ids.py)
    engine_headers: dict[str, str]
    prompt: str | list[int] | None = None
    batch: bool = False
    prompt_token_ids: list[int] | None = None
    # Engine URL that served each leg, for the X-Pdgate-*-Engine response headers.
    served_by: dict[str, str] = field(default_factory=dict)
    # The client's request headers (case-insensitive), for policies such as `session`.
    client_headers: Mapping[str, str] = field(default_factory=dict)
    # The client's own X-Request-Id (sanitised), for logs and the response header only.
    client_request_id: str | None = None

    @property
    def stream(self) -> bool:
        return bool(self.params.stream)

    @property
    def n(self) -> int:
        return self.params.n or 1

    @property
    def max_tokens(self) -> int | None:
        return self.params.max_tokens or self.params.max_completion_tokens

    @property
    def wants_usage_chunks(self) -> bool:
        opts = self.params.stream_options
        return opts is not None and bool(opts.include_usage or opts.continuous_usage_stats)


T = TypeVar("T")

_decode_object = msgspec.json.Decoder(dict[str, Any]).decode
_PATH_RE = re.compile(r"- at `\$\.?([^`]*)`")
_MISSING_RE = re.compile(r"missing required field `([^`]+)`")


def _decode(raw: bytes) -> dict[str, Any]:
    try:
        return _decode_object(raw)
    except msgspec.ValidationError:
        raise InvalidRequest("request body must be a JSON object") from None
    except msgspec.DecodeError as exc:
        raise InvalidRequest(f"request body is not valid JSON: {exc}") from None


def _convert(body: dict[str, Any], typ: type[T]) -> T:
    try:
        return msgspec.convert(body, typ)
    except msgspec.ValidationError as exc:
        raise InvalidRequest(str(exc), param=_param_of(str(exc))) from None


def _param_of(message: str) -> str | None:
    """The JSON path msgspec names in `message`, as OpenAI's `param` (e.g.
    `messages[0].role`)."""
    path_match = _PATH_RE.search(message)
    path = path_match.group(1) if path_match else ""
    missing = _MISSING_RE.search(message)
    if missing:
        path = f"{path}.{missing.group(1)}" if path else missing.group(1)
    return path or None


def parse_completion(raw: bytes) -> tuple[dict[str, Any], CompletionParams]:
    """Decode and validate a completions body; returns (raw object, validated view)."""
    body = _decode(raw)
    return body, _convert(body, CompletionParams)


def parse_chat(raw: bytes) -> tuple[dict[str, Any], ChatParams]:
    """Decode and validate a chat completions body; returns (raw object, validated view)."""
    body = _decode(raw)
    return body, _convert(body, ChatParams)


def classify_prompt(prompt: str | list[Any]) -> tuple[str | list[int] | None, bool]:
    """Split a completions `prompt` into (single prompt or None, is_batch).

    Accepts a string, a list of token ids, a list of strings or a list of token-id lists;
    a one-element list of either counts as that single prompt.
    """
    if isinstance(prompt, str):
        return prompt, False
    if not prompt:
        raise InvalidRequest("prompt must not be empty", param="prompt")
    if all(_is_token(t) for t in prompt):
        return list(prompt), False
    if all(isinstance(p, str) for p in prompt):
        return (prompt[0], False) if len(prompt) == 1 else (None, True)
    if all(isinstance(p, list) and p and all(_is_token(t) for t in p) for p in prompt):
        return (list(prompt[0]), False) if len(prompt) == 1 else (None, True)
    raise InvalidRequest(
        "prompt must be a string, a list of token ids, a list of strings "
        "or a list of token-id lists",
        param="prompt",
    )


def _is_token(t: Any) -> bool:
    return isinstance(t, int) and not isinstance(t, bool) and t >= 0
