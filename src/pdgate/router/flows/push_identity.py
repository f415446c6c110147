"""Where a push-mode decode leg gets its prefill engine's NIXL identity, per engine.

In push mode D registers the prompt's blocks with P over NIXL, so D's leg must name P:
engine id, side channel (host, port) and, for vLLM, P's parallel layout (`tp_size`,
`pp_size`). Two kinds of prefill engine serve `--pd-mode push`:

- pdgate's engine shim answers `POST /v1/kv/info` (cached per URL by `KVInfoCache`).
- vLLM with `NixlPushConnector` has no such route (404). Its identity is in the
  `kv_transfer_params` of each of its prefill answers (`remote_engine_id`, `remote_host`,
  `remote_port`, `tp_size`, `pp_size`, `transfer_mode: "push"`). The first request to
  such an engine runs its legs one after the other (P first, D with the identity P
  answered: P WRITEs once D registers, in either order, so nothing leaks), and later ones
  send both legs at once with the cached identity. Every answer is compared with the
  cache: an engine restarted under another engine id is re-learnt from its first answer,
  and a decode failure forgets the identity (the next request learns it again).
  A vLLM engine that answers `transfer_mode: "pull"` (the plain `NixlConnector`) is
  remembered as such; its requests run the pull flow.

A data-parallel vLLM prefill engine (router/dp_ranks.py) has one identity per DP rank
(vLLM names rank r's engine `<engine id>_dp<r>`, with its own side-channel port). Each rank
is an endpoint of its own, so identities are cached per endpoint key (`url@rank`), and the
prefill leg is pinned to the rank whose identity D's leg names. An answer that names a
sibling rank's identity (the engine ignored the pin) is counted
(`pdgate_engine_answers_refused_total{reason="dp_rank"}`) and is not cached for the rank
asked: the flow sends D's leg again with the identity P answered (`Learned.CHANGED`), so
D registers with the rank that holds the prompt.

vLLM matches D's registration to P's prefill by request id with its random suffix
stripped, so both legs must carry the same `X-Request-Id` (the router sends its own id on
both legs, router/request_ids.py).
"""

from __future__ import annotations

import enum
import logging
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, TypeGuard

import msgspec

from pdgate.contract.engine_replies import KVInfo
from pdgate.router.errors import EngineRejected
from pdgate.router.flows.bodies import remote_prefill
from pdgate.router.flows.common import KVInfoCache
from pdgate.router.input.schema import ClientRequest
from pdgate.router.metrics import RouterMetrics
from pdgate.router.pool import Endpoint

__all__ = ["Learned", "PushPeers", "ShimPeer", "VllmIdentity", "VllmPeer",
           "vllm_request_id"]

log = logging.getLogger(__name__)
# vLLM's engine id of DP rank r ends with `_dp<r>` (v1/engine/core.py).
_DP_SUFFIX = re.compile(r"_dp(\d+)$")


class VllmIdentity(msgspec.Struct, frozen=True):
    """What a vLLM decode engine needs to find a NixlPushConnector prefill engine."""

    engine_id: str
    host: str
    port: int
    tp_size: int = 1
    pp_size: int = 1

    @classmethod
    def of_answer(cls, params: Any) -> VllmIdentity | None:
        """The identity in a prefill answer's `kv_transfer_params`; None unless it is a
        well-formed push answer."""
        if not isinstance(params, Mapping) or params.get("transfer_mode") != "push":
            return None
        engine_id, host, port = (params.get("remote_engine_id"), params.get("remote_host"),
                                 params.get("remote_port"))
        tp, pp = params.get("tp_size", 1), params.get("pp_size", 1)
        if not (isinstance(engine_id, str) and isinstance(host, str) and _count(port)
                and _count(tp) and _count(pp)):
            return None
        return cls(engine_id, host, port, tp, pp)

    def decode_params(self, remote_request_id: str) -> dict[str, Any]:
        """D's `kv_transfer_params`: "P pushes this prompt's KV" (no `remote_block_ids`: D
        allocates its blocks and registers them with P)."""
        return remote_prefill({
            "remote_engine_id": self.engine_id, "remote_host": self.host,
            "remote_port": self.port, "tp_size": self.tp_size, "pp_size": self.pp_size,
            "remote_request_id": remote_request_id,
        })


def _count(value: Any) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def vllm_request_id(req: ClientRequest) -> str:
    """The id P's vLLM gives this request before its random suffix (D names it as
    `remote_request_id`; vLLM uses it only for lease heartbeats). vLLM builds it from the
    `X-Request-Id` header: `cmpl-<id>-<prompt index>` or `chatcmpl-<id>`."""
    if req.kind == "chat":
        return f"chatcmpl-{req.request_id}"
    return f"cmpl-{req.request_id}-0"


@dataclass(frozen=True, slots=True)
class ShimPeer:
    """A shim prefill engine: its `POST /v1/kv/info` answer."""

    info: KVInfo


@dataclass(frozen=True, slots=True)
class VllmPeer:
    """A vLLM prefill engine; `identity` None: not learnt yet (run the legs in turn)."""

    identity: VllmIdentity | None


class Learned(enum.Enum):
    """What a vLLM prefill answer says about its engine, against the identity D was given."""

    SAME = "same"  # a push answer naming the identity D has: P pushes to it
    CHANGED = "changed"  # a push answer naming another identity (now cached)
    PULL = "pull"  # a pull-mode answer (plain NixlConnector): D must READ instead
    NONE = "none"  # no usable KV params: D computes the prompt itself


class PushPeers:
    """Each prefill endpoint's kind and identity, by endpoint key (URL, or `url@rank` for
    a DP rank). One per push flow (the app's); `metrics` counts rank mismatches."""

    def __init__(self, info: KVInfoCache, metrics: RouterMetrics | None = None) -> None:
        self._info = info
        self._metrics = metrics
        self._vllm: dict[str, VllmIdentity | None] = {}  # key -> identity; None: unknown
        self._pull: set[str] = set()  # keys that answered as pull-mode engines
        self.rank_mismatches = 0  # answers that named a sibling DP rank's identity
        self._dp_hinted: set[str] = set()  # URLs told to set --prefill-dp-size

    def pull_only(self, ep: Endpoint) -> bool:
        """True once `ep` answered as a pull-mode vLLM engine (its requests run pull)."""
        return ep.key in self._pull

    def identity(self, ep: Endpoint) -> VllmIdentity | None:
        """The identity cached for `ep` (None: not learnt, or not a vLLM engine)."""
        return self._vllm.get(ep.key)

    async def get(self, ep: Endpoint, headers: Mapping[str, str]) -> ShimPeer | VllmPeer:
        """`ep`'s kind and what is known of its identity. Raises what `/v1/kv/info` raised,
        except its 404 (a vLLM engine)."""
        if ep.key in self._vllm:
            return VllmPeer(self._vllm[ep.key])
        try:
            return ShimPeer(await self._info.get(ep, headers))
        except EngineRejected as exc:
            if exc.status != 404:
                raise
        self._vllm[ep.key] = None
        return VllmPeer(None)

    def learn(self, ep: Endpoint, params: Any, sent: VllmIdentity | None) -> Learned:
        """Read P's answer: cache the identity it names and say how it compares with
        `sent` (what D's leg named; None: D's leg is not out yet)."""
        identity = VllmIdentity.of_answer(params)
        if identity is not None:
            if identity == sent:
                return Learned.SAME
            if self._sibling_of(ep, identity):
                return Learned.CHANGED  # D is told this identity; the cache stays as is
            self._vllm[ep.key] = identity
            self._pull.discard(ep.key)
            return Learned.CHANGED
        if isinstance(params, Mapping) and params.get("remote_block_ids") is not None:
            self._pull.add(ep.key)
            return Learned.PULL
        return Learned.NONE

    def _sibling_of(self, ep: Endpoint, identity: VllmIdentity) -> bool:
        """True (counted, logged) when `identity` is another DP rank's of `ep`'s engine:
        the engine ran the prefill on a rank other than the one the leg was pinned to."""
        if ep.rank is None:
            if _DP_SUFFIX.search(identity.engine_id) and ep.url not in self._dp_hinted:
                self._dp_hinted.add(ep.url)  # once per engine: every answer may say so
                log.warning("prefill engine %s answers as a data-parallel vLLM engine (%s): "
                            "without --prefill-dp-size its ranks take turns and push legs "
                            "are sent twice when they differ", ep.url, identity.engine_id)
            return False
        prefix = f"{ep.url}@"
        sibling = next((k for k, known in self._vllm.items()
                        if known == identity and k != ep.key and k.startswith(prefix)), None)
        named = _DP_SUFFIX.search(identity.engine_id)
        if sibling is None and named is not None and int(named[1]) != ep.rank:
            sibling = f"{prefix}{named[1]}"  # vLLM's per-rank engine id says which rank
        if sibling is None:
            return False
        self.rank_mismatches += 1
        if self._metrics is not None:
            self._metrics.child(self._metrics.engine_answers_refused, "dp_rank").inc()
        log.warning("prefill engine %s answered with the identity of %s (its DP-rank header "
                    "was not honoured): the decode leg is sent again", ep.key, sibling)
        return True

    def answer(self, ep: Endpoint, params: Any, sent: VllmIdentity | None,
               req: ClientRequest) -> tuple[Learned, dict[str, Any] | None]:
        """`learn` from P's answer to `req`, plus the decode params D needs unless it is
        `SAME`: P's identity (`CHANGED`; `remote_request_id` as P answered it), P's own
        params (`PULL`: D READs) or None (`NONE`: D computes the prompt)."""
        learned = self.learn(ep, params, sent)
        if learned is Learned.CHANGED:
            identity = VllmIdentity.of_answer(params)
            assert identity is not None
            rid = params.get("remote_request_id")
            return learned, identity.decode_params(
                rid if isinstance(rid, str) else vllm_request_id(req))
        if learned is Learned.PULL:
            return learned, dict(params)
        return learned, None

    def forget(self, ep: Endpoint) -> None:
        """Drop `ep`'s identity (a decode leg that named it failed): the next request
        learns it again from P's answer."""
        if ep.key in self._vllm:
            self._vllm[ep.key] = None
