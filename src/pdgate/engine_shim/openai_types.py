"""OpenAI / vLLM wire types of the shim's HTTP API: request structs, their validation, and
the JSON bodies of replies, stream chunks and errors.

Requests decode with msgspec (unknown fields are ignored, as OpenAI clients send many; the
known ones the shim does not implement, such as `logprobs`, `tools` or `response_format`,
are refused by name in `check_unsupported`, never silently ignored);
`RequestError` carries the HTTP status and the OpenAI error fields, so bad input is always a
4xx with `{"error": {"message", "type", "param", "code"}}`, never a 500.
Only `n == 1` and a single prompt are served: the router never sends more through P/D (one
set of prefill blocks is never shared by several decode children).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, TypeVar

import msgspec

from pdgate.contract.kv_contract import (
    Continuation,
    KVParamsError,
    PdgateLeg,
    parse_continuation,
    parse_pdgate_params,
)
from pdgate.engine_shim.sampler import SamplingParams
from pdgate.engine_shim.sequence import StepOutput

_SEED_RANGE = (-(2**63), 2**64 - 1)


class RequestError(Exception):
    """Bad client input: rendered as an OpenAI error body with HTTP `status`."""

    def __init__(
        self, message: str, *, param: str | None = None, status: int = 400,
        error_type: str = "BadRequestError",
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.status = status
        self.error_type = error_type


def error_body(message: str, error_type: str, status: int, param: str | None = None) -> bytes:
    """`{"error": {...}}` as vLLM's OpenAI server writes it (`code` is the HTTP status)."""
    return msgspec.json.encode(
        {"error": {"message": message, "type": error_type, "param": param, "code": status}}
    )


class StreamOptions(msgspec.Struct, kw_only=True):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _Common(msgspec.Struct, kw_only=True):
    """Fields shared by /v1/completions and /v1/chat/completions (OpenAI + vLLM extras)."""

    model: str | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    n: int = 1
    stop: str | list[str] | None = None
    include_stop_str_in_output: bool = False
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    stream: bool = False
    stream_options: StreamOptions | None = None
    kv_transfer_params: dict[str, Any] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    best_of: int | None = None
    user: str | None = None
    # vLLM's request priority (lower is earlier; the router sends it with
    # --forward-priority): accepted and checked to be an integer, not honoured: the shim's
    # scheduler admits in arrival order (engine_shim/scheduler.py).
    priority: int = 0
    # vLLM's extension: the reply's choice also lists `prompt_token_ids` and `token_ids`
    # (the router's pull flow uses them to stream P's first token early); a stream's
    # chunks list the ids each one's text comes from (the router's mid-stream migration),
    # the first also the prompt's (chat: at the chunk's top level, as vLLM 0.32 does).
    return_token_ids: bool = False
    # vLLM's tool calling and constrained decoding, which the shim does not implement: typed
    # loosely so that any value reaches `check_unsupported` and is refused there by name
    # (an engine that ignored them would answer 200 with unconstrained text).
    tools: list[Any] | None = None
    tool_choice: Any = None
    functions: list[Any] | None = None
    function_call: Any = None
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None


class CompletionRequest(_Common, kw_only=True):
    """POST /v1/completions. `prompt`: a string, a token-id list, or a one-element list of
    either. `max_tokens` defaults to 16 (OpenAI/vLLM legacy completions)."""

    prompt: str | list[Any]
    echo: bool = False
    logprobs: int | None = None
    suffix: str | None = None
    add_special_tokens: bool = True


class ChatMessage(msgspec.Struct, kw_only=True):
    role: str
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None


class ChatCompletionRequest(_Common, kw_only=True):
    """POST /v1/chat/completions. The chat template is applied with the generation prompt;
    the text is then tokenized without special tokens unless `add_special_tokens`."""

    messages: list[ChatMessage]
    logprobs: bool | None = None
    top_logprobs: int | None = None
    add_special_tokens: bool = False


class AbortRequest(msgspec.Struct, kw_only=True):
    """POST /v1/kv/abort: free the blocks a prefill engine pinned for `request_id`, and a
    decode engine's reservations for it. `write_possible: false` says no prefill engine was
    ever asked to write into those reservations (the router gave up before dispatching P),
    so they are freed at once instead of after the grace a landing WRITE may need."""

    request_id: str
    write_possible: bool = True


_Body = TypeVar("_Body", bound=msgspec.Struct)


def decode_request(body: bytes, kind: type[_Body]) -> _Body:
    """Decode and type-check a JSON body; raises RequestError naming the bad field. Hostile
    bodies are 400s too: invalid UTF-8 anywhere (JSON text is UTF-8; msgspec alone would
    skip bad bytes in unknown keys) and nesting too deep to decode (RecursionError, also
    inside fields typed `Any`). Bodies are size-bounded before this (`body_limit.py`)."""
    try:
        body.decode()
        return msgspec.json.decode(body, type=kind)
    except msgspec.ValidationError as e:
        match = re.search(r"at `\$\.([A-Za-z_]+)", str(e))
        raise RequestError(str(e), param=match.group(1) if match else None) from e
    except msgspec.DecodeError as e:
        raise RequestError(f"request body is not valid JSON: {e}") from e
    except UnicodeDecodeError as e:
        raise RequestError(f"request body is not valid UTF-8: {e.reason} at byte "
                           f"{e.start}") from e
    except RecursionError as e:
        raise RequestError("request body is nested too deeply") from e


def check_unsupported(req: CompletionRequest | ChatCompletionRequest) -> None:
    """Reject options the shim does not implement instead of silently ignoring them."""
    if req.n != 1:
        raise RequestError(
            "only n=1 is supported by the engine shim (send n separate requests)", param="n"
        )
    if req.best_of not in (None, 1):
        raise RequestError("best_of is not supported", param="best_of")
    for name in ("presence_penalty", "frequency_penalty"):
        if getattr(req, name) not in (None, 0):
            raise RequestError(f"{name} is not supported", param=name)
    if req.repetition_penalty not in (None, 1):
        raise RequestError("repetition_penalty is not supported", param="repetition_penalty")
    if req.logit_bias:
        raise RequestError("logit_bias is not supported", param="logit_bias")
    if req.logprobs not in (None, False) or getattr(req, "top_logprobs", None):
        raise RequestError("logprobs are not supported by the engine shim", param="logprobs")
    if isinstance(req, CompletionRequest):
        if req.echo:
            raise RequestError("echo is not supported", param="echo")
        if req.suffix:
            raise RequestError("suffix is not supported", param="suffix")
    _check_no_constraints(req)


# Fields whose presence (anything but null or empty) asks for tool calls or constrained
# output; `tool_choice` "none" and `response_format` {"type": "text"} ask for neither.
_CONSTRAINTS = ("tools", "functions", "function_call", "structured_outputs", "guided_json",
                "guided_regex", "guided_choice", "guided_grammar")


def _check_no_constraints(req: CompletionRequest | ChatCompletionRequest) -> None:
    for name in _CONSTRAINTS:
        if getattr(req, name) not in (None, [], {}, ""):
            raise RequestError(f"{name} is not supported by the engine shim", param=name)
    if req.tool_choice not in (None, "none"):
        raise RequestError("tool_choice is not supported by the engine shim",
                           param="tool_choice")
    if req.response_format not in (None, {}) and req.response_format != {"type": "text"}:
        raise RequestError("response_format is not supported by the engine shim (only "
                           '{"type": "text"})', param="response_format")


def sampling_params(req: CompletionRequest | ChatCompletionRequest) -> SamplingParams:
    """OpenAI sampling fields -> SamplingParams (temperature 1, top_p 1, top_k off)."""
    top_k = -1 if req.top_k in (None, 0) else req.top_k
    if req.seed is not None and not _SEED_RANGE[0] <= req.seed <= _SEED_RANGE[1]:
        raise RequestError("seed must fit in 64 bits", param="seed")
    try:
        return SamplingParams(
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            top_k=top_k if top_k is not None else -1,
            seed=req.seed,
        )
    except ValueError as e:
        param = str(e).split(" ", 1)[0]
        raise RequestError(str(e), param=param) from e


def max_tokens(req: CompletionRequest | ChatCompletionRequest, default: int | None) -> int | None:
    """The completion budget asked for (`max_completion_tokens` wins), validated >= 1."""
    value = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    if value is None:
        return default
    if value < 1:
        name = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        raise RequestError(f"{name} must be at least 1, got {value}", param=name)
    return value


def stop_strings(req: CompletionRequest | ChatCompletionRequest) -> tuple[str, ...]:
    stops = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    if any(not s for s in stops):
        raise RequestError("stop strings must be non-empty", param="stop")
    return tuple(stops)


def completion_prompt(prompt: str | list[Any]) -> str | list[int]:
    """Normalise `prompt` to one string or one token-id list (vocab range checked later)."""
    if isinstance(prompt, str):
        return prompt
    if prompt and all(_is_int(t) for t in prompt):
        return list(prompt)
    if len(prompt) == 1 and isinstance(prompt[0], str):
        return str(prompt[0])
    if len(prompt) == 1 and isinstance(prompt[0], list) and prompt[0]:
        if all(_is_int(t) for t in prompt[0]):
            return list(prompt[0])
    if len(prompt) > 1 and all(isinstance(p, str | list) for p in prompt):
        raise RequestError(
            "only one prompt per request is supported (send one request per prompt)",
            param="prompt",
        )
    raise RequestError(
        "prompt must be a non-empty string, a list of token ids, or a one-element list of either",
        param="prompt",
    )


def chat_messages(messages: list[ChatMessage]) -> list[dict[str, str]]:
    """Messages as plain dicts for the chat template; content parts must be text."""
    if not messages:
        raise RequestError("messages must be a non-empty list", param="messages")
    out: list[dict[str, str]] = []
    for m in messages:
        if isinstance(m.content, list):
            texts = []
            for part in m.content:
                if part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise RequestError("only text content parts are supported", param="messages")
                texts.append(part["text"])
            content = "\n".join(texts)
        else:
            content = m.content or ""
        out.append({"role": m.role, "content": content})
    return out


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


# ---- replies (plain dicts encoded with msgspec; shapes follow vLLM's OpenAI server) ----


def usage(out: StepOutput) -> dict[str, Any]:
    return {
        "prompt_tokens": out.num_prompt_tokens,
        "completion_tokens": out.num_output_tokens,
        "total_tokens": out.num_prompt_tokens + out.num_output_tokens,
        "prompt_tokens_details": {"cached_tokens": out.num_cached_tokens},
    }


def completion_body(head: ReplyHead, text: str, final: StepOutput,
                    prompt_ids: list[int] | None = None) -> dict[str, Any]:
    """Non-streaming /v1/completions reply; with `prompt_ids` (`return_token_ids`), the
    choice lists the prompt's and the generated token ids as vLLM's does."""
    choice: dict[str, Any] = {"index": 0, "text": text, "logprobs": None,
                              "finish_reason": final.finish_reason,
                              "stop_reason": final.stop_reason}
    if prompt_ids is not None:
        choice["prompt_token_ids"] = prompt_ids
        choice["token_ids"] = list(final.token_ids or ())
    return {**head.fields("text_completion"), "choices": [choice], "usage": usage(final),
            "kv_transfer_params": final.kv_transfer_params}


def chat_body(head: ReplyHead, text: str, final: StepOutput) -> dict[str, Any]:
    """Non-streaming /v1/chat/completions reply."""
    choice = {"index": 0, "message": {"role": "assistant", "content": text},
              "logprobs": None, "finish_reason": final.finish_reason,
              "stop_reason": final.stop_reason}
    return {**head.fields("chat.completion"), "choices": [choice], "usage": usage(final),
            "kv_transfer_params": final.kv_transfer_params}


class ReplyHead(msgspec.Struct, frozen=True):
    """id / created / model shared by a reply and all of its stream chunks."""

    id: str
    created: int
    model: str
    include_usage: bool = False

    def fields(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def chunk(self, chat: bool, choices: list[dict[str, Any]]) -> dict[str, Any]:
        body = {**self.fields("chat.completion.chunk" if chat else "text_completion"),
                "choices": choices}
        if self.include_usage:
            body["usage"] = None  # OpenAI: every chunk carries `usage`, null until the last
        return body


def stream_choice(chat: bool, out: StepOutput | None, *, first: bool = False,
                  token_ids: bool = False) -> dict[str, Any]:
    """One streamed choice: a text delta (or, for chat, the opening role delta when `first`);
    with `token_ids`, the ids of the tokens the delta comes from (`return_token_ids`)."""
    if chat:
        delta: dict[str, Any] = {"role": "assistant", "content": ""} if first else {}
        if out is not None and out.text:
            delta["content"] = out.text
        choice: dict[str, Any] = {"index": 0, "delta": delta, "logprobs": None}
    else:
        choice = {"index": 0, "text": out.text if out else "", "logprobs": None}
    choice["finish_reason"] = out.finish_reason if out else None
    choice["stop_reason"] = out.stop_reason if out else None
    if token_ids and out is not None:
        choice["token_ids"] = list(out.new_token_ids)
    return choice


def sse(data: dict[str, Any]) -> bytes:
    return b"data: " + msgspec.json.encode(data) + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"


class KVTransferParams(msgspec.Struct, kw_only=True):
    """vLLM's keys of `kv_transfer_params`, as its NixlConnector reads them.

    Prefill role: `do_remote_decode=true` (the rest null). Decode role: `do_remote_prefill=
    true` plus where P's blocks are (`remote_engine_id`, `remote_block_ids`, `remote_host`,
    `remote_port`, `remote_request_id`, `tp_size`). pdgate's notify and push legs carry
    their own keys instead (contract/kv_contract.py), some under the same `remote_*` names."""

    do_remote_decode: bool = False
    do_remote_prefill: bool = False
    remote_engine_id: str | None = None
    remote_block_ids: list[int] | None = None
    remote_host: str | None = None
    remote_port: int | None = None
    remote_request_id: str | None = None
    tp_size: int | None = None


@dataclass(frozen=True)
class CheckedKV:
    """A request's checked `kv_transfer_params`: vLLM's keys, pdgate's notify/push leg
    (None: vLLM pull, or no transfer) and the early-token continuation (None: none)."""

    params: KVTransferParams
    leg: PdgateLeg | None
    continuation: Continuation | None


# What a pull decode leg must name to READ P's blocks (pdgate's legs: contract/kv_contract.py).
_PULL_REQUIRES = ("remote_engine_id", "remote_block_ids", "remote_host", "remote_port")


def kv_transfer_params(raw: dict[str, Any] | None) -> CheckedKV | None:
    """Type-check `kv_transfer_params` (None when absent); a bad key is a 400 naming it. A
    request asking for neither role may still carry `first_token_ids`."""
    if raw is None:
        return None
    try:  # pdgate's keys first: their messages say what the value must be
        leg = parse_pdgate_params(raw)
        continuation = parse_continuation(raw)
    except KVParamsError as e:
        raise RequestError(str(e), param=e.field) from e
    try:
        params = msgspec.convert(raw, KVTransferParams)
    except msgspec.ValidationError as e:
        match = re.search(r"at `\$\.([A-Za-z_]+)", str(e))
        field = f"kv_transfer_params.{match.group(1)}" if match else "kv_transfer_params"
        raise RequestError(f"invalid kv_transfer_params: {e}", param=field) from e
    if params.do_remote_decode and params.do_remote_prefill:
        raise RequestError(
            "kv_transfer_params: do_remote_decode and do_remote_prefill are exclusive",
            param="kv_transfer_params",
        )
    if params.do_remote_prefill and leg is None:
        missing = [name for name in _PULL_REQUIRES if getattr(params, name) is None]
        if missing:
            raise RequestError(
                f"kv_transfer_params with do_remote_prefill needs {', '.join(missing)}",
                param=f"kv_transfer_params.{missing[0]}",
            )
        if any(b < 0 for b in params.remote_block_ids or []):
            raise RequestError("kv_transfer_params.remote_block_ids must be >= 0",
                               param="kv_transfer_params.remote_block_ids")
    return CheckedKV(params, leg, continuation)


def first_token_ids(kv: CheckedKV | None, vocab_size: int, budget: int) -> tuple[int, ...]:
    """`first_token_ids` of checked params (any decode, also without a transfer): tokens
    already generated and delivered; at least one token must be left to generate."""
    ids = tuple(kv.continuation.first_token_ids) if kv and kv.continuation else ()
    if len(ids) >= budget:
        raise RequestError(f"kv_transfer_params.first_token_ids: {len(ids)} tokens leave none "
                           f"of max_tokens={budget} to generate",
                           param="kv_transfer_params.first_token_ids")
    if any(not 0 <= t < vocab_size for t in ids):
        raise RequestError(f"kv_transfer_params.first_token_ids out of range [0, {vocab_size})",
                           param="kv_transfer_params.first_token_ids")
    return ids
