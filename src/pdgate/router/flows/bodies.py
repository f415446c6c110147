"""The two leg bodies every flow sends, built in one place.

Prefill leg: the client's body, non-streaming, one token, with `kv_transfer_params` asking P
to keep the prompt's KV for a remote decode (vLLM NixlConnector: `do_remote_decode`), plus
what the flow adds (notify: D's blocks and the KV-ready address; push: the mode). Decode
leg: the client's body with the KV params D needs (pull: P's reply params, passed through
as an opaque blob; notify/push: `remote_prefill(...)`), or without any (D computes the
prompt). Neither function modifies the client's body.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import msgspec

__all__ = ["decode_leg_body", "prefill_leg_body", "remote_prefill"]

_json_encode = msgspec.json.Encoder().encode
# Fields P must not see: it answers with one token and no stream.
_PREFILL_DROP = ("stream_options", "min_tokens", "min_completion_tokens")


def prefill_leg_body(body: Mapping[str, Any], extra: Mapping[str, Any] | None = None) -> bytes:
    """The P leg's JSON; `extra` adds flow-specific `kv_transfer_params` keys."""
    b = dict(body)
    for key in _PREFILL_DROP:
        b.pop(key, None)
    # vLLM's NixlConnector reads these four as "no remote KV yet" on a prefill request.
    b["kv_transfer_params"] = {
        "do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
        "remote_block_ids": None, "remote_host": None, "remote_port": None, **(extra or {}),
    }
    b["stream"] = False
    b["max_tokens"] = 1
    if "max_completion_tokens" in b:
        b["max_completion_tokens"] = 1
    return _json_encode(b)


def decode_leg_body(body: Mapping[str, Any], kv_params: Any | None,
                    token_ids: bool = False) -> bytes:
    """The D leg's JSON: `kv_params` as its `kv_transfer_params` (None: any the client sent
    are removed, so D computes the prompt itself). A stream always asks D for its final
    usage chunk: the router's token counters need it, and the relay removes it again for
    a client that did not ask (`strip_usage_events`). `token_ids`: D lists each chunk's
    token ids (`ClientRequest.track_ids`: a stream that may migrate; the client gets none)."""
    b = dict(body)
    b.pop("kv_transfer_params", None)
    if token_ids:
        b["return_token_ids"] = True
    if kv_params is not None:
        b["kv_transfer_params"] = kv_params
    if b.get("stream") is True:
        opts = b.get("stream_options")
        if not (isinstance(opts, Mapping) and opts.get("include_usage")):
            b["stream_options"] = {**(opts if isinstance(opts, Mapping) else {}),
                                   "include_usage": True}
    return _json_encode(b)


def remote_prefill(params: Mapping[str, Any]) -> dict[str, Any]:
    """Decode-leg params of the notify and push flows: "the prompt's KV comes from P"."""
    return {"do_remote_prefill": True, "do_remote_decode": False, **params}
