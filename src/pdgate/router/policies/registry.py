"""The read-only policy registry and the factory that turns a config spec into a `Selector`.

Adding a policy: write one class (kebab-case `type`, frozen `Params`, `scorers`, async
`pick`; see `router.policies.base.Policy`) in its own module and add it to `_BUILTINS`.
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Any

from pdgate.router.config import ConfigError, PolicySpec
from pdgate.router.metrics import RouterMetrics
from pdgate.router.policies.base import Policy, PolicyEnv, parse_params
from pdgate.router.policies.consistent_hash import ConsistentHash
from pdgate.router.policies.kv_aware import KVEventsAware
from pdgate.router.policies.least_inflight import LeastInflight
from pdgate.router.policies.load_aware import LoadAware
from pdgate.router.policies.power_of_two import PowerOfTwo
from pdgate.router.policies.prefix_aware import PrefixAware
from pdgate.router.policies.prefix_text import PrefixText
from pdgate.router.policies.random_pick import RandomPick
from pdgate.router.policies.round_robin import RoundRobin
from pdgate.router.policies.runner import Selector
from pdgate.router.policies.session import Session

__all__ = ["ALIASES", "POLICIES", "POLICY_NAMES", "build_policy", "check_policy",
           "policy_spec"]

_BUILTINS: tuple[type[Any], ...] = (
    RoundRobin,
    LeastInflight,
    PowerOfTwo,
    RandomPick,
    Session,
    ConsistentHash,
    PrefixAware,
    PrefixText,
    KVEventsAware,
    LoadAware,
)

POLICIES: MappingProxyType[str, type[Policy]] = MappingProxyType(
    {cls.type: cls for cls in _BUILTINS}
)
"""Registered policy classes by `type` name (read-only)."""

ALIASES: MappingProxyType[str, str] = MappingProxyType({
    # vllm-router's policy names, for configurations migrated from it.
    "round_robin": "round-robin",
    "power_of_two": "power-of-two",
    # vllm-router's cache_aware matches the prompt's characters (no tokenizer), as
    # prefix-text does; its consistent_hash is a ring every replica agrees on.
    "cache_aware": "prefix-text",
    "consistent_hash": "consistent-hash",
})
"""Other names accepted for a registered type (read-only)."""

POLICY_NAMES = frozenset(POLICIES) | frozenset(ALIASES)
"""Every accepted `type`: registered names and aliases."""


def policy_spec(spec: str | PolicySpec) -> PolicySpec:
    """A bare type name is the spec `{type: name}` with default params; an alias becomes
    the type it names."""
    spec = PolicySpec(type=spec) if isinstance(spec, str) else spec
    if spec.type in ALIASES:
        return PolicySpec(type=ALIASES[spec.type], name=spec.name, params=spec.params)
    return spec


def check_policy(spec: str | PolicySpec) -> tuple[type[Policy], Any]:
    """The class and parsed params of `spec`; `ConfigError` names the policy and field."""
    spec = policy_spec(spec)
    cls = POLICIES.get(spec.type)
    if cls is None:
        known = ", ".join([*POLICIES, *(f"{a} (= {t})" for a, t in ALIASES.items())])
        raise ConfigError(f"unknown policy {spec.type!r} (known: {known})")
    return cls, parse_params(spec.name or spec.type, spec.params, cls.Params)


def build_policy(
    spec: str | PolicySpec,
    env: PolicyEnv | None = None,
    metrics: RouterMetrics | None = None,
) -> Selector:
    """A fresh `Selector` for `spec` (a type name or a `{type, name, params}` spec).

    `env` is the shared state (default: a private one with no KV events). Raises
    `ConfigError` for an unknown type or bad params (the message names both)."""
    cls, params = check_policy(spec)
    env = env or PolicyEnv()
    policy = cls(params, env)  # type: ignore[call-arg]
    return Selector(policy, env, policy_spec(spec).name or cls.type, metrics)
