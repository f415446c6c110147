"""The engine replies the router reads, typed: what a prefill engine answers a completion
(vLLM's fields), and the shim's `/v1/kv/info` and `/v1/kv/reserve` answers.

The router decodes each reply once, at its engine-client edge (router/engines/replies.py),
into these structs; a reply that does not fit (a missing `engine_id`, a port out of range, a
field of the wrong type) is an `EngineProtocolError` there (a 502), never a KeyError deeper
in. The shim answers with the same structs. Unknown fields are ignored (engines add fields
between versions); the ones below are what the router relies on.

`ModelList` is an engine's `GET /v1/models`: vLLM lists its base model(s) and every LoRA
adapter it has loaded, an adapter with its `parent` (the base model) and its `root` (the path
it was loaded from); the router learns which engine holds which adapter from it.

`PrefillKV` is the router's view of the few `kv_transfer_params` keys of P's reply it
reads (the params themselves travel to D as an opaque object): vLLM's
`remote_request_id`, `remote_block_ids` and `remote_num_tokens`, and pdgate's
`pdgate_mode` and `first_token_ids` (contract/kv_contract.py).
"""

from __future__ import annotations

from typing import Annotated, Any

import msgspec

__all__ = [
    "MAX_FIRST_TOKENS",
    "ChatMessage",
    "Choice",
    "CompletionReply",
    "KVInfo",
    "KVReservation",
    "ModelCard",
    "ModelList",
    "PrefillKV",
    "Usage",
]

# P samples one token; a few more would still be a tiny head. More is not a first token.
MAX_FIRST_TOKENS = 16
TokenId = Annotated[int, msgspec.Meta(ge=0)]
Port = Annotated[int, msgspec.Meta(ge=1, le=65535)]
NonEmpty = Annotated[str, msgspec.Meta(min_length=1)]


class Usage(msgspec.Struct):
    """`usage` of a reply: the prompt side of billing as the engine counted it."""

    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    total_tokens: int | None = None
    prompt_tokens_details: Any = None


class ChatMessage(msgspec.Struct):
    """A chat choice's `message` (tool calls and other fields are not read)."""

    role: str | None = None
    content: str | None = None


class Choice(msgspec.Struct):
    """One choice of a completion reply. `prompt_token_ids` and `token_ids` are vLLM's
    `return_token_ids` extension (the prompt's ids and the sampled ones)."""

    index: int = 0
    text: str | None = None
    message: ChatMessage | None = None
    finish_reason: str | None = None
    prompt_token_ids: list[TokenId] | None = None
    token_ids: list[TokenId] | None = None


class CompletionReply(msgspec.Struct):
    """A non-streaming completion reply (`/v1/completions`, `/v1/chat/completions`), as the
    router reads P's. `id`: vLLM names it `cmpl-<X-Request-Id>` (chat:
    `chatcmpl-<X-Request-Id>`), as does the shim."""

    choices: list[Choice]
    id: str | None = None
    object: str | None = None
    created: int | None = None
    model: str | None = None
    usage: Usage | None = None
    kv_transfer_params: dict[str, Any] | None = None


class PrefillKV(msgspec.Struct):
    """The keys of P's `kv_transfer_params` the router reads (see the module doc)."""

    remote_request_id: str | None = None
    remote_block_ids: Any = None  # vLLM 0.32: one list per KV-cache group; the shim: ints
    remote_num_tokens: int | None = None
    pdgate_mode: str | None = None
    first_token_ids: Annotated[list[TokenId], msgspec.Meta(max_length=MAX_FIRST_TOKENS)] | None \
        = None


class KVInfo(msgspec.Struct):
    """`POST /v1/kv/info`: the engine's NIXL identity and side channel. `landed_tokens`:
    its landed notices name the tokens it sampled (push: D may continue after them)."""

    engine_id: NonEmpty
    host: NonEmpty
    port: Port
    agent_name: str | None = None
    block_size: int | None = None
    num_blocks: int | None = None
    kv_layout: str | None = None
    landed_tokens: bool = False


class KVReservation(msgspec.Struct):
    """`POST /v1/kv/reserve` (notify mode): D's identity plus the blocks it reserved for
    `num_tokens` prompt tokens, under `reservation_id`."""

    engine_id: NonEmpty
    host: NonEmpty
    port: Port
    reservation_id: NonEmpty
    block_ids: list[TokenId]
    agent_name: str | None = None
    num_tokens: int | None = None
    block_size: int | None = None
    num_blocks: int | None = None
    kv_layout: str | None = None
    landed_tokens: bool = False


class ModelCard(msgspec.Struct):
    """One entry of an engine's `/v1/models`: `parent` is set for a LoRA adapter (its base
    model), `root` is the base model's path or the adapter's source path."""

    id: NonEmpty
    root: str | None = None
    parent: str | None = None
    max_model_len: int | None = None


class ModelList(msgspec.Struct):
    """An engine's `GET /v1/models` answer."""

    data: list[ModelCard]
