"""Per-request generation state: tokens, blocks, stop conditions and streamed text.

A `Sequence` is created by the engine when a request is admitted and is only touched from the
event-loop thread (the engine loop hands the model thread immutable snapshots). Its KV lives
in `block_ids`: positions `0..num_computed-1` are in the cache; `token_ids[num_computed:]` are
the tokens the next model step must feed. That one rule covers prefill (num_computed = 0),
decode (one token to feed), a decode engine that pulled the prompt's KV (num_computed = N-1),
and recompute after preemption (num_computed reset to 0).
"""

from __future__ import annotations

import asyncio
import enum
from dataclasses import dataclass, field
from typing import Any, Protocol

from pdgate.contract.kv_contract import PdgateLeg
from pdgate.engine_shim.sampler import Sampler, SamplingParams

# Prompt tokens decoded together with the first output tokens, so tokenizers that drop a
# word's leading space when it starts a decode (SentencePiece) render output text correctly.
_DETOK_CONTEXT = 5


class EngineError(Exception):
    """A request failure the HTTP layer turns into an OpenAI error body with `status`."""

    status = 500
    error_type = "InternalServerError"


class PromptTooLong(EngineError):
    status = 400
    error_type = "BadRequestError"


class OutOfKVBlocks(EngineError):
    status = 503
    error_type = "ServiceUnavailableError"


class EngineStopped(EngineError):
    status = 503
    error_type = "ServiceUnavailableError"


class KVLoadFailed(EngineError):
    """The remote KV could not be loaded and `--kv-load-failure-policy fail` forbids
    recomputing it (a 502: the router retries elsewhere or tells the client)."""

    status = 502
    error_type = "KVTransferError"


class KVRole(enum.Enum):
    """What `kv_transfer_params` asked of this request (vLLM NixlConnector semantics)."""

    NONE = "colocated"
    PREFILL = "prefill"  # do_remote_decode: keep the prompt's blocks for a remote reader
    DECODE = "decode"  # do_remote_prefill: read the prompt's KV from a remote engine


class Tokenizer(Protocol):
    """The slice of a HF tokenizer the detokenizer uses."""

    def decode(self, token_ids: list[int], skip_special_tokens: bool = ...) -> str: ...


@dataclass(frozen=True)
class GenerateRequest:
    """One generation job, already tokenized and validated by the HTTP layer.

    `max_tokens` >= 1 counts generated tokens (EOS included). `stop` strings end generation
    and are cut from the text (kept with `include_stop_str`, vLLM's
    `include_stop_str_in_output`); `stop_token_ids` end it too. `min_tokens` suppresses EOS,
    stop ids and stop strings until that many tokens exist. `remote` holds the parsed
    `kv_transfer_params` of a DECODE-role request (opaque to the engine, given to the
    connector's `pull`); `pdgate` the checked keys of a notify/push leg (None: vLLM pull, or
    no transfer). `first_token_ids` continue a generation begun elsewhere: tokens the
    prefill engine sampled and the client already has; they count as output (max_tokens,
    usage) but their text is not sent again. `continue_after_prefill` (a push decode leg)
    asks to continue after the token(s) P's landed notice names, instead of sampling.
    `model` is the served model name the request asked for, its metrics' `model` label
    ("": the engine's first served name, filled in at admission)."""

    request_id: str
    prompt_ids: tuple[int, ...]
    sampling: SamplingParams
    max_tokens: int
    min_tokens: int = 0
    stop: tuple[str, ...] = ()
    include_stop_str: bool = False
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    role: KVRole = KVRole.NONE
    remote: Any = None
    pdgate: PdgateLeg | None = None
    remote_block_ids: tuple[int, ...] = ()
    first_token_ids: tuple[int, ...] = ()
    continue_after_prefill: bool = False
    model: str = ""
    # An output for every token, with empty text while its text is held back (vLLM 0.32's
    # stream with `return_token_ids`: each chunk lists its one token's id).
    every_token: bool = False

    @property
    def continues_stream(self) -> bool:
        """The client's stream already holds this request's opening (P's token, role)."""
        return bool(self.first_token_ids) or self.continue_after_prefill


@dataclass(frozen=True)
class StepOutput:
    """What one request produced since its previous output.

    `text` is complete UTF-8 text only (a character split across tokens waits for its last
    byte); the final output (finish_reason set) flushes everything left. Token counts are
    cumulative. `kv_transfer_params` is set only on the final output of a PREFILL-role
    request whose blocks were handed to the connector."""

    text: str
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    kv_transfer_params: dict[str, Any] | None = None
    # The generated token ids, on the final output only (vLLM's `return_token_ids`).
    token_ids: tuple[int, ...] | None = None
    # The ids generated since the previous output (a streamed chunk's `token_ids`): the
    # tokens whose text this output's `text` completes, so text and ids stay aligned.
    new_token_ids: tuple[int, ...] = ()


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas without re-decoding everything.

    Keeps a short window of ids: the text of `ids[prefix:read]` is already emitted; a new
    token is emitted as `decode(ids[prefix:]) - decode(ids[prefix:read])` once it no longer
    ends in U+FFFD (a partial multi-byte character)."""

    def __init__(self, tokenizer: Tokenizer, prompt_ids: tuple[int, ...]) -> None:
        self._tok = tokenizer
        self._ids = list(prompt_ids[-_DETOK_CONTEXT:])
        self._prefix = 0
        self._read = len(self._ids)

    def push(self, token_id: int) -> str:
        self._ids.append(token_id)
        return self._advance(final=False)

    def flush(self) -> str:
        """Whatever is still held back (possibly ending in U+FFFD) at the end of a request."""
        return self._advance(final=True)

    def _advance(self, *, final: bool) -> str:
        if self._read == len(self._ids):
            return ""
        before = self._tok.decode(self._ids[self._prefix : self._read], skip_special_tokens=True)
        after = self._tok.decode(self._ids[self._prefix :], skip_special_tokens=True)
        if len(after) <= len(before) or (after.endswith("\ufffd") and not final):
            return ""
        self._prefix, self._read = self._read, len(self._ids)
        return after[len(before) :]


@dataclass(eq=False)
class Sequence:
    """Mutable state of one admitted request (event-loop thread only)."""

    req: GenerateRequest
    detok: IncrementalDetokenizer
    eos_ids: frozenset[int]
    max_model_len: int
    admit_order: int
    token_ids: list[int] = field(default_factory=list)
    block_ids: list[int] = field(default_factory=list)
    num_computed: int = 0
    num_cached_tokens: int = 0
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    cancelled: bool = False
    submitted: bool = False
    # What the request's reader receives: outputs, the last with finish_reason set, or an
    # EngineError that ends the request.
    queue: asyncio.Queue[StepOutput | EngineError] = field(default_factory=asyncio.Queue)
    sampler: Sampler = field(init=False)
    _text: str = ""
    _emitted: int = 0
    _ids_out: int = 0  # token_ids already listed in an output's `new_token_ids`

    def __post_init__(self) -> None:
        self.token_ids = list(self.req.prompt_ids)
        self.sampler = Sampler(self.req.sampling)
        self.resume(self.req.first_token_ids)

    def resume(self, token_ids: tuple[int, ...]) -> None:
        """Continue after `token_ids`, sampled elsewhere and already delivered: they become
        output (max_tokens, usage) whose text is never emitted. Before any output only."""
        for token in token_ids:
            # Through the detokenizer so later text continues exactly where the client's
            # copy of these tokens ends (a split character included).
            self.token_ids.append(token)
            self._text += self.detok.push(token)
        self._emitted = len(self._text)
        self._ids_out = len(self.token_ids)  # the client has these ids already

    @property
    def num_prompt(self) -> int:
        return len(self.req.prompt_ids)

    @property
    def num_output(self) -> int:
        return len(self.token_ids) - self.num_prompt

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def banned_tokens(self) -> tuple[int, ...]:
        """Token ids the sampler must not pick now (EOS and stop ids before `min_tokens`)."""
        if self.num_output >= self.req.min_tokens:
            return ()
        eos = () if self.req.ignore_eos else tuple(self.eos_ids)
        return eos + self.req.stop_token_ids

    def append(self, token_id: int) -> StepOutput | None:
        """Record a sampled token, apply stop conditions, and return the output to send (None
        when there is no new complete text and the request goes on)."""
        self.token_ids.append(token_id)
        self._check_stop_token(token_id)
        if not self.finished:
            checked = len(self._text)
            self._text += self.detok.push(token_id)
            self._check_stop_strings(checked)
        if not self.finished and (
            self.num_output >= self.req.max_tokens or len(self.token_ids) >= self.max_model_len
        ):
            self.finish_reason = "length"
        if self.finished and not isinstance(self.stop_reason, str):
            # Ended by a token or by length: nothing is cut, so release held-back bytes.
            self._text += self.detok.flush()
        return self._emit()

    def _check_stop_token(self, token_id: int) -> None:
        if self.num_output < self.req.min_tokens:
            return
        if token_id in self.req.stop_token_ids:
            self.finish_reason, self.stop_reason = "stop", token_id
        elif not self.req.ignore_eos and token_id in self.eos_ids:
            self.finish_reason = "stop"

    def _check_stop_strings(self, checked: int) -> None:
        """vLLM's `check_stop_strings`: a match that ends after `checked` (the text before
        it was checked on earlier tokens); the earliest-ending wins, ties by list order;
        the text is cut at its start, or at its end when it is included."""
        if not self.req.stop or self.num_output < self.req.min_tokens:
            return
        best: tuple[int, int, str] | None = None
        for stop in self.req.stop:
            i = self._text.find(stop, max(0, checked - len(stop) + 1))
            if i >= 0 and (best is None or i + len(stop) < best[1]):
                best = (i, i + len(stop), stop)
        if best is not None:
            start, end, stop = best
            self._text = self._text[:end if self.req.include_stop_str else start]
            self.finish_reason, self.stop_reason = "stop", stop

    def _emit(self) -> StepOutput | None:
        end = len(self._text)
        if not self.finished and self.req.stop and not self.req.include_stop_str:
            # Hold back a tail that may be the start of a stop string still being generated
            # (vLLM's `stop_buffer_length`: the longest stop string less one character).
            end -= max(len(s) for s in self.req.stop) - 1
        delta = self._text[self._emitted : end] if end > self._emitted else ""
        self._emitted = max(self._emitted, end)
        if not delta and not self.finished and not (
                self.req.every_token and self._ids_out < len(self.token_ids)):
            return None
        return self.output(delta)

    def output(self, text: str, kv_transfer_params: dict[str, Any] | None = None) -> StepOutput:
        start = max(self._ids_out, self.num_prompt)
        self._ids_out = len(self.token_ids)
        return StepOutput(
            text=text,
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
            num_prompt_tokens=self.num_prompt,
            num_output_tokens=self.num_output,
            num_cached_tokens=self.num_cached_tokens,
            kv_transfer_params=kv_transfer_params,
            token_ids=tuple(self.token_ids[self.num_prompt:]) if self.finished else None,
            new_token_ids=tuple(self.token_ids[start:]),
        )
