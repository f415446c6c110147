"""`kv_transfer_params` of the vLLM NixlConnector pull protocol, as the shim reads and writes them.

P's reply (`hold_params`) carries exactly vLLM's fields (`do_remote_prefill`,
`do_remote_decode`, `remote_engine_id`, `remote_request_id`, `remote_block_ids`,
`remote_host`, `remote_port`, `tp_size`) plus one shim extension, `remote_agent_name`, which
lets a shim D notice that P restarted (new NIXL agent) before it reads with stale metadata.
vLLM ignores unknown keys, and the shim D treats the extension as optional.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from pdgate.engine_shim.transfer_errors import KVTransferError


def _bad(message: str) -> KVTransferError:
    return KVTransferError(message, reason="params")


@dataclass(frozen=True)
class PullParams:
    """What D needs from P's params to read the blocks."""

    engine_id: str
    request_id: str
    block_ids: tuple[int, ...]
    host: str
    port: int
    agent_name: str | None  # shim extension; None from a vLLM P


def hold_params(
    *, engine_id: str, request_id: str, block_ids: list[int], host: str, port: int,
    agent_name: str,
) -> dict[str, object]:
    """P's `kv_transfer_params` for a request whose blocks are pinned for a remote decode."""
    return {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_engine_id": engine_id,
        "remote_request_id": request_id,
        "remote_block_ids": list(block_ids),
        "remote_host": host,
        "remote_port": port,
        "tp_size": 1,
        "remote_agent_name": agent_name,
    }


def _field(params: Mapping[str, object], key: str, kind: type) -> object:
    value = params.get(key)
    if not isinstance(value, kind) or isinstance(value, bool) and kind is not bool:
        raise _bad(
            f"kv_transfer_params.{key} must be {kind.__name__}, got {value!r}")
    return value


def parse_pull_params(params: Mapping[str, object]) -> PullParams:
    """Validate P's params on D; raises KVTransferError naming the first bad field."""
    blocks = _field(params, "remote_block_ids", list)
    assert isinstance(blocks, list)
    if not all(isinstance(b, int) and not isinstance(b, bool) and b >= 0 for b in blocks):
        raise _bad("kv_transfer_params.remote_block_ids must be ints >= 0")
    tp = params.get("tp_size", 1)
    if tp != 1:
        raise _bad(f"kv_transfer_params.tp_size {tp!r} unsupported (only 1)")
    port = _field(params, "remote_port", int)
    assert isinstance(port, int)
    if not 0 < port < 65536:
        raise _bad(f"kv_transfer_params.remote_port {port} out of range")
    agent = params.get("remote_agent_name")
    return PullParams(
        engine_id=str(_field(params, "remote_engine_id", str)),
        request_id=str(_field(params, "remote_request_id", str)),
        block_ids=tuple(blocks),
        host=str(_field(params, "remote_host", str)),
        port=port,
        agent_name=agent if isinstance(agent, str) else None,
    )
