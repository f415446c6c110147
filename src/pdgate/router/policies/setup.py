"""Builds the routing parts of one app from its config: the shared `PolicyEnv`, one
`Selector` per leg, the decider, and (with `--kv-events`) the KV-event subscribers, whose
tasks are bound to the caller's exit stack. Called by `router.app` in its lifespan."""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass

from pdgate.router.config import ConfigError, PolicySpec, RouterConfig
from pdgate.router.metrics import RouterMetrics
from pdgate.router.policies.base import PolicyEnv, parse_params
from pdgate.router.policies.decider import Decider, DecodePrefixLookup, PrefixDecider
from pdgate.router.policies.kv_events import (
    KVEventIndex,
    parse_kv_event_endpoints,
    running_subscribers,
)
from pdgate.router.policies.measured_cost import MeasuredCostDecider, MeasuredCostParams
from pdgate.router.policies.prefix_index import PrefixIndex, block_hashes
from pdgate.router.policies.registry import build_policy, check_policy
from pdgate.router.policies.runner import Selector
from pdgate.router.pool import EndpointPool

__all__ = ["DECIDERS", "Routing", "build_decider", "check_routing", "open_routing"]

DECIDERS = ("static", "measured-cost")
"""The `--decider` types."""


@dataclass(frozen=True)
class Routing:
    """What the orchestrator needs to route: a selector per leg and the decider."""

    prefill: Selector
    decode: Selector
    decider: Decider
    env: PolicyEnv

    @property
    def needs_tokens(self) -> bool:
        """Whether a policy or the decider reads the prompt's tokens."""
        return self.prefill.needs_tokens or self.decode.needs_tokens or self.decider.needs_tokens

    @property
    def reads_engine_load(self) -> bool:
        """Whether a policy or the decider reads engines' own load (their /metrics)."""
        return (self.prefill.reads_engine_load or self.decode.reads_engine_load
                or self.decider.reads_engine_load)


def check_routing(config: RouterConfig) -> None:
    """Fail at startup on bad policy params (`ConfigError` naming policy and field)."""
    check_policy(config.prefill_policy)
    check_policy(config.decode_policy)
    _decider_params(config.decider)


async def open_routing(
    config: RouterConfig,
    pool: EndpointPool,
    metrics: RouterMetrics,
    stack: contextlib.AsyncExitStack,
) -> Routing:
    """Build the routing state; KV-event subscribers run until `stack` closes."""
    endpoints = parse_kv_event_endpoints(config.kv_events)
    exact = None
    if endpoints:
        exact = KVEventIndex(config.prefix_block_size, config.prefix_index_max_blocks)
        metrics.labels(metrics.prefix_index_entries, "kv_events").set_function(
            lambda: len(exact.index))

        def on_batch(engine: str, n: int, gap: bool) -> None:
            metrics.child(metrics.kv_event_batches, engine).inc()
            if gap:
                metrics.child(metrics.kv_event_gaps, engine).inc()

        await stack.enter_async_context(running_subscribers(endpoints, exact, on_batch,
                                                           pool.dp_size))
    approx = PrefixIndex(config.prefix_index_max_blocks)
    metrics.labels(metrics.prefix_index_entries, "approx").set_function(lambda: len(approx))
    env = PolicyEnv(config.prefix_block_size, approx, exact)
    decode = build_policy(config.decode_policy, env, metrics)
    static = PrefixDecider(
        config.disagg_min_tokens, config.disagg_prefix_ratio,
        _decode_prefix_lookup(pool, env) if config.disagg_prefix_ratio else None,
        colocated=config.pd_mode == "colocated",
    )
    decider = build_decider(config.decider, static, pool, metrics)
    return Routing(build_policy(config.prefill_policy, env, metrics), decode, decider, env)


def _decider_params(spec: str | PolicySpec) -> MeasuredCostParams | None:
    """The params of a `--decider` spec (None for `static`, which takes none: its bounds
    are `--disagg-min-tokens` and `--disagg-prefix-ratio`); `ConfigError` names the field."""
    spec = PolicySpec(type=spec) if isinstance(spec, str) else spec
    if spec.type not in DECIDERS:
        raise ConfigError(f"decider: unknown type {spec.type!r} (known: {', '.join(DECIDERS)})")
    if spec.type == "static":
        if spec.params:
            raise ConfigError("decider 'static' takes no params (its bounds are "
                              "disagg_min_tokens and disagg_prefix_ratio)")
        return None
    return parse_params(f"decider {spec.name or spec.type}", spec.params, MeasuredCostParams)


def build_decider(spec: str | PolicySpec, static: PrefixDecider, pool: EndpointPool,
                  metrics: RouterMetrics | None = None) -> Decider:
    """The decider of `spec`: `static` itself, or the measured-cost decider bounded by
    `static`'s rules. A per-model config builds one per model the same way."""
    params = _decider_params(spec)
    if params is None:
        return static
    return MeasuredCostDecider(params, static, pool, metrics)


def _decode_prefix_lookup(pool: EndpointPool, env: PolicyEnv) -> DecodePrefixLookup:
    """Leading prompt tokens the best healthy decode engine holds (from its KV events
    where it publishes them, else from the router's own index)."""

    def lookup(token_ids: Sequence[int]) -> int:
        hashes = block_hashes(token_ids, env.block_size)
        urls = [ep.key for ep in pool.healthy("decode")]
        if not hashes or not urls:
            return 0
        matched = env.matched_blocks(hashes, urls, use_events=True)
        return max(matched.values(), default=0) * env.block_size

    return lookup
