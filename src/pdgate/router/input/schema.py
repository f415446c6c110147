"""Client request validation: typed views of the OpenAI fields the router checks.

The raw JSON object is kept and forwarded untouched (engines may support fields the router
has never heard of); the msgspec structs below only validate the fields the router itself
relies on, and ignore the rest. Validation failures raise `InvalidRequest` with `param` set
to the offending field.

Every body that cannot be decoded is an `InvalidRequest` too: nesting deeper than
`max_json_depth` is refused before decoding (router/input/limits.py), invalid UTF-8 (overlong
forms, encoded surrogates, stray bytes) and unpaired `\ud800`-style escapes by msgspec, so
no decoded string holds a lone surrogate.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal, TypeVar

import msgspec
from msgspec import Meta

from pdgate.router.errors import InvalidRequest
from pdgate.router.input.limits import InputLimits, check_json_depth

__all__ = [
    "ChatParams",
    "ClientRequest",
    "CompletionParams",
    "classify_prompt",
    "parse_chat",
    "parse_completion",
]

PositiveInt = Annotated[int, Meta(ge=1)]
TokenId = Annotated[int, Meta(ge=0)]
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
    chat_template: str | None = None  # a client template: refused unless allowed
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
    # The `PickContext` policies see, built by the first leg that chooses an engine and
    # shared by the others (with the prompt hashes it computed): `PickContext.of`.
    pick_context: Any = None
    # The LoRA adapter `model` names (router/adapters.py `AdapterNeed`), None: the base model.
    adapter: Any = None
    # The router asked the engines for `return_token_ids` on its own (mid-stream
    # migration, router/flows/migration.py): the client did not, and gets none.
    track_ids: bool = False

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

_DEFAULT_LIMITS = InputLimits()
_decode_object = msgspec.json.Decoder(dict[str, Any]).decode
_PATH_RE = re.compile(r"- at `\$\.?([^`]*)`")
_MISSING_RE = re.compile(r"missing required field `([^`]+)`")


def _decode(raw: bytes, limits: InputLimits) -> dict[str, Any]:
    check_json_depth(raw, limits.max_json_depth)
    try:
        return _decode_object(raw)
    except msgspec.ValidationError:
        raise InvalidRequest("request body must be a JSON object") from None
    except msgspec.DecodeError as exc:
        raise InvalidRequest(f"request body is not valid JSON: {_explain(raw, exc)}") from None
    except UnicodeDecodeError as exc:  # msgspec's error for bad UTF-8 inside a string
        raise InvalidRequest(f"request body is not valid UTF-8 ({exc.reason})") from None
    except RecursionError:  # only if the depth check let something through
        raise InvalidRequest("request body nests arrays/objects too deeply") from None


def _explain(raw: bytes, exc: msgspec.DecodeError) -> str:
    message = str(exc)
    # msgspec reports `"\ud800x"` as truncated input; say what is actually wrong.
    if ("surrogate" in message or "truncated" in message) and (
            b"\\ud" in raw or b"\\uD" in raw):
        message += " (a \\ud800-\\udfff escape must be half of a surrogate pair)"
    return message


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


def parse_completion(raw: bytes, limits: InputLimits | None = None
                     ) -> tuple[dict[str, Any], CompletionParams]:
    """Decode and validate a completions body; returns (raw object, validated view)."""
    body = _decode(raw, limits or _DEFAULT_LIMITS)
    return body, _convert(body, CompletionParams)


def parse_chat(raw: bytes, limits: InputLimits | None = None
               ) -> tuple[dict[str, Any], ChatParams]:
    """Decode and validate a chat completions body; returns (raw object, validated view).
    More than `limits.max_messages` messages are refused before they are validated."""
    limits = limits or _DEFAULT_LIMITS
    body = _decode(raw, limits)
    messages = body.get("messages")
    if isinstance(messages, list) and len(messages) > limits.max_messages:
        raise InvalidRequest(f"at most {limits.max_messages} messages are accepted",
                             param="messages")
    return body, _convert(body, ChatParams)


def classify_prompt(prompt: str | list[Any]) -> tuple[str | list[int] | None, bool]:
    """Split a completions `prompt` into (single prompt or None, is_batch).

    Accepts a string, a list of token ids, a list of strings or a list of token-id lists;
    a one-element list of either counts as that single prompt. Token lists are checked by
    msgspec (a 4 MiB body holds two million ids: no Python loop over them).
    """
    if isinstance(prompt, str):
        return prompt, False
    if not prompt:
        raise InvalidRequest("prompt must not be empty", param="prompt")
    if (ids := _as(prompt, list[TokenId])) is not None:
        return ids, False
    if all(isinstance(p, str) for p in prompt):
        return (prompt[0], False) if len(prompt) == 1 else (None, True)
    if (lists := _as(prompt, list[Annotated[list[TokenId], Meta(min_length=1)]])) is not None:
        return (lists[0], False) if len(lists) == 1 else (None, True)
    raise InvalidRequest(
        "prompt must be a string, a list of token ids, a list of strings "
        "or a list of token-id lists",
        param="prompt",
    )


def _as(value: Any, typ: type[T]) -> T | None:
    try:
        return msgspec.convert(value, typ)
    except msgspec.ValidationError:
        return None
