"""Prompt tokenization: a fast HF tokenizer, loaded once per app, with the chat template.

Loaded through `transformers.PreTrainedTokenizerFast` (not `AutoTokenizer`): AutoTokenizer
imports `transformers.configuration_utils`, which imports torch whenever torch is installed,
and the router must never import torch. Every checkpoint served by vLLM ships a
`tokenizer.json`, which is all the fast class needs.

Encoding goes straight to the Rust backend (`backend_tokenizer`), which is thread-safe;
prompts longer than `THREAD_THRESHOLD_CHARS` are encoded in a worker thread so a huge prompt
does not stall the event loop. Before that, `char_limit` lets the caller refuse a prompt
whose length alone proves it cannot fit: the vocabulary is scanned once at load for the
most characters one token can cover (common/char_bound.py, the shim's rule too).

Chat templates are rendered here rather than by `apply_chat_template`, with the same
variables (vLLM's semantics for `chat_template_kwargs`) but in the budget-enforcing
sandbox (router/input/template_sandbox.py): the model's own template in this process (a
worker thread for big inputs), a client-supplied one (only if allowed) in a template
worker process (router/input/template_workers.py).
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import anyio.to_thread
from jinja2 import Template

from pdgate.common import char_bound
from pdgate.common.char_bound import max_chars_per_token
from pdgate.router.errors import InvalidRequest
from pdgate.router.input.limits import InputLimits
from pdgate.router.input.template_sandbox import BoundedEnvironment, render_bounded, rendered_size
from pdgate.router.input.template_workers import TemplateWorkers, worker_count

__all__ = ["THREAD_THRESHOLD_CHARS", "PromptTokenizer", "check_chat", "load_tokenizer",
           "max_chars_per_token"]

THREAD_THRESHOLD_CHARS = 2000
# HF uses a huge sentinel (int(1e30)) for "no limit" in model_max_length.
_NO_LIMIT = 10**8
# Keys of chat_template_kwargs that are apply_chat_template options, not template
# variables; none changes the text (tokenize=False), so they are dropped.
_CALL_OPTIONS = ("tokenize", "padding", "truncation", "max_length", "return_tensors",
                 "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs",
                 "sanitize_control_tokens")
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "  # transformers' marker, same handling
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


class PromptTokenizer:
    """Counts prompt tokens for completions and chat. Methods are called on the event loop.

    `max_model_len` is the context length in tokens, or None when unknown;
    `max_chars_per_token` the most characters one token covers, or None when the
    tokenizer's pipeline can drop or merge characters without bound (no character bound).
    """

    def __init__(self, hf_tokenizer: Any, max_model_len: int | None,
                 limits: InputLimits | None = None) -> None:
        self._hf = hf_tokenizer
        self._backend = hf_tokenizer.backend_tokenizer
        self.max_model_len = max_model_len
        self.max_chars_per_token = max_chars_per_token(self._backend)
        self.limits = limits or InputLimits()
        self._env = BoundedEnvironment()
        self._compiled: dict[str, Template] = {}  # the model's own templates
        self._special = dict(hf_tokenizer.special_tokens_map)
        self._workers = self._client_workers()

    def with_limits(self, limits: InputLimits, max_model_len: int | None = None
                    ) -> PromptTokenizer:
        """This tokenizer (sharing its vocabulary scan and compiled templates) under other
        limits and, if given, another context length. Call `aclose()` on the copy."""
        clone = copy.copy(self)
        clone.limits = limits
        clone.max_model_len = max_model_len or self.max_model_len
        clone._workers = clone._client_workers()
        return clone

    def _client_workers(self) -> TemplateWorkers | None:
        if not self.limits.allow_client_chat_template:
            return None
        return TemplateWorkers(self.limits, worker_count())

    async def aclose(self) -> None:
        """Stop the client-template workers, if any."""
        if self._workers is not None:
            await self._workers.aclose()

    def char_limit(self, max_tokens: int | None) -> int | None:
        """Prompt length in characters beyond which the prompt plus `max_tokens` (at least
        one) cannot fit the context: longer ones need not be tokenized. None: no bound."""
        return char_bound.char_limit(self.max_model_len, max_tokens, self.max_chars_per_token)

    def min_tokens(self, chars: int) -> int:
        """The fewest tokens `chars` characters of text can be (needs a character bound)."""
        assert self.max_chars_per_token is not None
        return char_bound.min_tokens(chars, self.max_chars_per_token)

    async def encode_prompt(self, text: str) -> list[int]:
        """Token ids of a completion prompt, special tokens (e.g. BOS) added as the engine
        would add them."""
        return await self.encode_text(text, add_special_tokens=True)

    async def encode_text(self, text: str, *, add_special_tokens: bool) -> list[int]:
        """Token ids of `text` (`add_special_tokens=False` for rendered chat prompts: the
        template already wrote BOS and friends)."""
        ids: list[int] = await self._run(len(text), self._encode, text, add_special_tokens,
                                          len(text) > THREAD_THRESHOLD_CHARS)
        return ids

    async def encode_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        template_kwargs: Mapping[str, Any] | None = None,
        chat_template: str | None = None,
    ) -> list[int]:
        """Token ids of `messages` rendered with the chat template (`render_chat`)."""
        text = await self.render_chat(messages, add_generation_prompt=add_generation_prompt,
                                      template_kwargs=template_kwargs,
                                      chat_template=chat_template)
        return await self.encode_text(text, add_special_tokens=False)

    def check_chat(self, messages: Sequence[Any], template_kwargs: Mapping[str, Any] | None,
                   chat_template: str | None) -> None:
        """`check_chat` under this tokenizer's limits."""
        check_chat(self.limits, messages, template_kwargs, chat_template)

    async def render_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        template_kwargs: Mapping[str, Any] | None = None,
        chat_template: str | None = None,
        stop_after: int | None = None,
    ) -> str:
        """The prompt text of `messages`. `chat_template` (or the `chat_template` key of
        `template_kwargs`) is a client-supplied template: refused unless the limits allow
        it. `stop_after`: rendering may stop once the text is longer than this (the caller
        only needs to know it is too long). Every failure is `InvalidRequest`."""
        self.check_chat(messages, template_kwargs, chat_template)
        kwargs = dict(template_kwargs or {})
        client = kwargs.pop("chat_template", None)
        client = chat_template if chat_template is not None else client
        call = _TemplateCall(messages, add_generation_prompt, kwargs, self._special)
        source = self._own_source(client, call.variables["tools"])
        if source is None:
            assert self._workers is not None and isinstance(client, str)
            text = await self._workers.render(client, call.variables, stop_after=stop_after)
        else:
            size = rendered_size(call.variables, THREAD_THRESHOLD_CHARS)
            text = await self._run(size, self._render_own, source, call.variables,
                                   stop_after)
        return call.finish(text, stop_after)

    def _own_source(self, client: Any, tools: Any) -> str | None:
        """The model's template to use, or None for a client template (rendered apart)."""
        named = self._hf.chat_template if isinstance(self._hf.chat_template, dict) else {}
        if client is not None and not (isinstance(client, str) and client in named):
            if not isinstance(client, str):
                raise InvalidRequest("chat_template must be a string", param="chat_template")
            return None
        try:
            return str(self._hf.get_chat_template(client, tools))
        except ValueError as exc:  # e.g. the model has no chat template
            raise InvalidRequest(f"cannot apply chat template: {exc}", param="messages") from None

    def _render_own(self, source: str, variables: dict[str, Any], stop_after: int | None
                    ) -> str:
        template = self._compiled.get(source)
        if template is None:
            try:
                template = self._compiled[source] = self._env.from_string(source)
            except Exception as exc:  # a broken model template: still nothing to serve
                raise InvalidRequest(f"cannot compile the chat template: {exc}",
                                     param="messages") from None
        return render_bounded(self._env, template, variables,
                              timeout_s=self.limits.chat_template_timeout_s,
                              max_chars=self.limits.chat_template_max_output_chars,
                              stop_after=stop_after)

    def token_text(self, ids: Sequence[int], before: Sequence[int] = ()) -> str:
        """The text `ids` add after the tokens `before`, as an engine streams them (decoded
        in context: a leading space or a completed character comes out right)."""
        decode = self._backend.decode
        head = decode(list(before), skip_special_tokens=True) if before else ""
        full: str = decode([*before, *ids], skip_special_tokens=True)
        return full[len(head):] if full.startswith(head) else full

    def _encode(self, text: str, special: bool, off_loop: bool = False) -> list[int]:
        """Token ids of `text`. Off the loop through `encode_batch`: the Rust backend's
        `encode` holds the GIL for the whole call (the event loop would freeze behind the
        worker thread), its batch call lets go of it."""
        backend = self._backend
        try:
            if off_loop:
                batch = backend.encode_batch([text], add_special_tokens=special)
                ids: list[int] = list(batch[0].ids)
            else:
                ids = backend.encode(text, add_special_tokens=special).ids
        except TypeError:
            # The Rust backend refuses str it cannot make UTF-8 (lone surrogates).
            if _is_utf8(text):
                raise
            raise InvalidRequest("prompt is not valid Unicode (lone surrogate)",
                                 param="prompt") from None
        return ids

    async def _run(self, size: int, fn: Callable[..., Any], *args: Any) -> Any:
        if size <= THREAD_THRESHOLD_CHARS:
            return fn(*args)
        return await anyio.to_thread.run_sync(fn, *args)


class _TemplateCall:
    """The variables one render sees, as transformers' apply_chat_template builds them
    (`chat_template_kwargs` override the named parameters, as vLLM does), and its
    `continue_final_message` handling."""

    def __init__(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool,
                 kwargs: dict[str, Any], special: Mapping[str, Any]) -> None:
        params: dict[str, Any] = {"add_generation_prompt": add_generation_prompt,
                                  "tools": None, "documents": None}
        for key in (*params, "continue_final_message", *_CALL_OPTIONS):
            if key in kwargs:
                params[key] = kwargs.pop(key)
        if "messages" in kwargs:
            raise InvalidRequest("chat_template_kwargs must not set messages",
                                 param="chat_template_kwargs")
        chat = [_template_message(m) for m in messages]
        self.continued = self._continue(chat, params.get("continue_final_message"),
                                        bool(params["add_generation_prompt"]))
        self.variables: dict[str, Any] = {
            **special, **kwargs, "messages": chat, "tools": params["tools"],
            "documents": params["documents"],
            "add_generation_prompt": params["add_generation_prompt"],
        }

    @staticmethod
    def _continue(chat: list[dict[str, Any]], field: Any, add_gen: bool) -> str | None:
        if not field:
            return None
        field = field if isinstance(field, str) else "content"
        if add_gen:
            raise InvalidRequest("continue_final_message and add_generation_prompt cannot "
                                 "both be set", param="chat_template_kwargs")
        final = chat[-1].get(field) if chat else None
        if not isinstance(final, str):
            raise InvalidRequest(f"continue_final_message: the last message has no {field!r} "
                                 "text to continue", param="chat_template_kwargs")
        chat[-1] = {**chat[-1], field: final + _CONTINUE_TAG}
        return final

    def finish(self, text: str, stop_after: int | None) -> str:
        """Cut the rendered text after the continued message, as transformers does."""
        if self.continued is None or (stop_after is not None and len(text) > stop_after):
            return text
        tag = _CONTINUE_TAG.strip()
        if self.continued.strip() not in text or tag not in text:
            raise InvalidRequest("continue_final_message: the chat template dropped the last "
                                 "message", param="chat_template_kwargs")
        at = text.rindex(tag)
        if text[at:at + len(_CONTINUE_TAG)] == _CONTINUE_TAG:
            return text[:at]
        return text[:at].rstrip()


def _template_message(message: Mapping[str, Any]) -> dict[str, Any]:
    """As transformers: None-valued keys dropped, reasoning under its usual names; and
    string content (the text parts of a multi-part content list, joined)."""
    msg = {k: v for k, v in _flatten_message(message).items() if v is not None}
    reasoning = next((msg[k] for k in _REASONING_FIELDS if k in msg), None)
    if reasoning is not None:
        msg = {"thinking": reasoning, **msg, "reasoning_content": reasoning}
    return msg


def _flatten_message(message: Mapping[str, Any]) -> dict[str, Any]:
    """Templates expect string content: join the text parts of a multi-part content list."""
    content = message.get("content")
    if not isinstance(content, list):
        return dict(message)
    texts = [p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text"]
    return {**message, "content": "\n".join(str(t) for t in texts)}


def check_chat(limits: InputLimits, messages: Sequence[Any],
               template_kwargs: Mapping[str, Any] | None, chat_template: str | None) -> None:
    """The router's rules for a chat request, checked whether or not it renders it (and
    with or without a tokenizer): at most `max_messages` messages, and no client-supplied
    template (`chat_template` or `chat_template_kwargs.chat_template`) unless the limits
    allow one."""
    if len(messages) > limits.max_messages:
        raise InvalidRequest(f"at most {limits.max_messages} messages are accepted",
                             param="messages")
    client = chat_template if chat_template is not None else \
        (template_kwargs or {}).get("chat_template")
    if client is not None and not limits.allow_client_chat_template:
        raise InvalidRequest("this router does not accept a chat_template from the client",
                             param="chat_template")


def _is_utf8(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def load_tokenizer(source: str, model: str, max_model_len: int | None) -> PromptTokenizer:
    """Load the tokenizer from a local directory or hub name (blocking; call at startup).

    The context length is `max_model_len` if given, else the model's `config.json`
    (`max_position_embeddings`) when `model` is a local directory, else the tokenizer's
    `model_max_length`, else unknown.
    """
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast.from_pretrained(source)
    limit = max_model_len or _model_config_limit(model) or _tokenizer_limit(hf)
    return PromptTokenizer(hf, limit)


def _model_config_limit(model: str) -> int | None:
    path = Path(model) / "config.json"
    try:
        value = json.loads(path.read_text()).get("max_position_embeddings")
    except (OSError, ValueError):
        return None
    return value if isinstance(value, int) and value > 0 else None


def _tokenizer_limit(hf: Any) -> int | None:
    value = getattr(hf, "model_max_length", None)
    return value if isinstance(value, int) and 0 < value < _NO_LIMIT else None
