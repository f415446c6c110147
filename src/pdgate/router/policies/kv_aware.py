"""`kv-events`: `prefix-aware` with an exact view of each engine's prefix cache.

The prefix score of an engine that publishes KV cache events (`--kv-events
ENGINE_URL=tcp://host:port`, vLLM's `--kv-events-config` format; see `router.kv_events`) comes
from the blocks it reported stored and not yet removed; an engine that has published nothing
yet is scored from the router's own index of routing decisions, exactly like
`prefix-aware`. Router replicas subscribed to the same engines therefore see the same cache
state and send the same prompt to the same engine without talking to each other.

Params: the same as `prefix-aware` (same defaults).
"""

from __future__ import annotations

from typing import ClassVar

from pdgate.router.policies.prefix_aware import PrefixAware

__all__ = ["KVEventsAware"]


class KVEventsAware(PrefixAware):
    """See the module docstring."""

    type: ClassVar[str] = "kv-events"
    use_events: ClassVar[bool] = True
