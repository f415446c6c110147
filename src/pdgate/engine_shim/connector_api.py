"""`KVConnectorAPI`: every call the engine and the server make on a KV connector, in one
Protocol (`connector.KVConnector` is the implementation; tests bring their own).

One Protocol rather than optional capabilities: a connector that cannot do something (a
test double that only pulls, say) implements the call by refusing it: `await_push` and
`push_blocks` raise `KVTransferError`, `await_landing` returns None, and the engine then
recomputes or fails the request as it does for any transfer that did not happen.
Thread: every call from the event-loop thread.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

from pdgate.contract.kv_contract import NotifyPrefillParams, PushDecodeParams, PushPrefillParams

__all__ = ["KVConnectorAPI"]


class KVConnectorAPI(Protocol):
    """See the module docstring; the lifespan calls `start` before serving, `close` after."""

    # -- lifecycle and views (server) --------------------------------------------------
    def start(self) -> None:
        """Blocking: bring the transport up (the lifespan runs it in a thread)."""
        ...

    def close(self) -> None:
        """Blocking: free every leased block, stop the transport. Idempotent."""
        ...

    def leased_blocks(self) -> int:
        """Blocks held for remote peers right now."""
        ...

    def kv_info(self) -> dict[str, object]:
        """Where peers find this engine (GET /v1/kv/info, POST /v1/kv/reserve)."""
        ...

    def abort(self, request_id: str) -> None:
        """Release whatever `request_id` holds (the router's POST /v1/kv/abort)."""
        ...

    # -- P side ------------------------------------------------------------------------
    def hold_for_remote_decode(self, request_id: str, block_ids: list[int]) -> dict[str, Any]:
        """Pull mode: pin `block_ids` under a lease; the `kv_transfer_params` of the reply."""
        ...

    def push_blocks(self, request_id: str, block_ids: list[int], num_tokens: int,
                    params: NotifyPrefillParams | PushPrefillParams,
                    first_token_ids: tuple[int, ...] = ()) -> dict[str, Any]:
        """Notify/push: hand a finished prompt's blocks over for a WRITE into D; the reply's
        params. Raises KVTransferError when it cannot (the caller keeps the blocks)."""
        ...

    def fail_push(self, request_id: str, reason: str, detail: str) -> None:
        """`request_id` will not be pushed; tell a D that registered for it."""
        ...

    # -- D side ------------------------------------------------------------------------
    async def pull_tokens(self, params: Mapping[str, object], local_block_ids: list[int],
                          num_tokens: int) -> int:
        """READ a `num_tokens` prompt's KV named by P's `params` into `local_block_ids`
        (P's block size may differ); bytes read. Raises KVConnectorError."""
        ...

    def expect_landing(self, tag: str) -> None:
        """A WRITE tagged `tag` is coming (notify mode's reservation)."""
        ...

    def forget_landing(self, tag: str) -> None:
        ...

    async def await_landing(self, tag: str, timeout: float) -> tuple[int, ...] | None:
        """The tokens P named once its WRITE landed (maybe none); None: it did not land."""
        ...

    async def await_push(self, params: PushDecodeParams, request_id: str,
                         local_block_ids: list[int], num_tokens: int
                         ) -> tuple[int, tuple[int, ...]]:
        """Push mode: register with P and wait for its WRITE; bytes received and the tokens
        P named in its landed notice. Raises KVTransferError."""
        ...
