"""Failover shared by every flow: who is to blame for a failed leg, and another attempt.

One retry loop, `with_failover`, serves every flow. Pull retries each leg on its own
(`run_leg`: choose → call → record success/failure on the breaker → another engine). Notify
and push send legs that depend on each other (D's reservation names P's write, D's leg names
P's identity), so they retry a whole *attempt*: every engine state the failed attempt created
is released by the flow first, then `with_failover` runs the attempt again on other engines,
up to `--max-retries` more times, before any byte went to the client. Their attempts get
their own engine-side request id (`attempt_request`), so a late write or notice of a failed
attempt can never meet the next one.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Awaitable, Callable
from typing import TypeVar

from pdgate.router.errors import (
    AdapterLoadFailed,
    AdapterUnavailable,
    EngineMisconfigured,
    EngineRejected,
    EngineTimeout,
    EngineUnavailable,
    NoEndpointAvailable,
    RouterError,
)
from pdgate.router.flows.base import FlowParts
from pdgate.router.health import backoff_s
from pdgate.router.input.schema import ClientRequest
from pdgate.router.metrics import RouterMetrics
from pdgate.router.policies import PickContext, Selector, choose
from pdgate.router.pool import Endpoint, EndpointPool, Role

__all__ = ["Exclusions", "LegFailure", "PullInstead", "attempt_request", "choose_prefill",
           "note_failure", "run_leg", "run_or_pull", "with_failover"]

log = logging.getLogger(__name__)
T = TypeVar("T")


def note_failure(role: Role, ep: Endpoint, exc: RouterError) -> bool:
    """Record a failed leg on `ep`'s health; True when another engine may be tried.

    A 4xx the client caused (`EngineRejected`) leaves the engine's record clean. A prefill
    timeout is retried, unlike a decode timeout: prefill is short, so a stall means a stuck
    engine (e.g. frozen), and a second P costs at most one more prefill deadline."""
    if isinstance(exc, EngineRejected):
        ep.health.record_success()
        return False
    ep.health.record_failure()
    if isinstance(exc, EngineUnavailable) and exc.connect_failed:
        ep.set_healthy(False)
    return exc.retryable or (role == "prefill" and isinstance(exc, EngineTimeout))


class LegFailure(RouterError):
    """A leg of an attempt failed on `ep` before any byte reached the client; the flow has
    already released what the attempt held. Carries the engine's error (same status)."""

    def __init__(self, role: Role, ep: Endpoint, error: RouterError, *,
                 pair: Endpoint | None = None) -> None:
        super().__init__(error.message, param=error.param)
        self.role, self.ep, self.error = role, ep, error
        # A KV transfer between two engines failed (blamed on `ep`, the receiver): the
        # sender `pair` is avoided by the next attempt where another engine can serve.
        self.pair = pair
        self.status, self.type, self.code = error.status, error.type, error.code
        self.retryable = error.retryable


@dataclasses.dataclass
class Exclusions:
    """Engines that failed in earlier attempts of one request, per role; `avoid_prefill`:
    prefill engines whose KV transfer to a failed decode engine failed (not to blame, but
    another one is preferred)."""

    prefill: list[Endpoint] = dataclasses.field(default_factory=list)
    decode: list[Endpoint] = dataclasses.field(default_factory=list)
    avoid_prefill: list[Endpoint] = dataclasses.field(default_factory=list)
    # prefill engines this request could not reach, or that dropped its connection: down
    # for it, though the pool may count them healthy until the next probe
    unreachable_prefill: list[Endpoint] = dataclasses.field(default_factory=list)

    def of(self, role: Role) -> list[Endpoint]:
        return self.prefill if role == "prefill" else self.decode


def attempt_request(req: ClientRequest, attempt: int) -> ClientRequest:
    """`req` as attempt `attempt` sends it: attempt 0 is `req` itself; later ones get their
    own engine-side id (and header) and share everything else (served_by included)."""
    if attempt == 0:
        return req
    rid = f"{req.request_id}-{attempt}"
    return dataclasses.replace(req, request_id=rid,
                               engine_headers={**req.engine_headers, "X-Request-Id": rid})


async def with_failover(
    req: ClientRequest, run: Callable[[ClientRequest, Exclusions], Awaitable[T]], *,
    max_retries: int, retry_backoff_s: float, metrics: RouterMetrics, fresh_ids: bool = True,
) -> T:
    """`run(attempt_req, exclusions)`, again on other engines after a `LegFailure` that
    `note_failure` deems retryable, up to `max_retries` more times. `fresh_ids`: later
    attempts get their own engine-side request id (`attempt_request`)."""
    return await _failover_from(0, None, req, run, Exclusions(), max_retries=max_retries,
                                retry_backoff_s=retry_backoff_s, metrics=metrics,
                                fresh_ids=fresh_ids)


async def _failover_from(
    first: int, failed: LegFailure | None, req: ClientRequest,
    run: Callable[[ClientRequest, Exclusions], Awaitable[T]], excluded: Exclusions, *,
    max_retries: int, retry_backoff_s: float, metrics: RouterMetrics, fresh_ids: bool,
) -> T:
    """`with_failover`'s loop from attempt `first`; `failed`: how attempt `first - 1`
    failed (run by the caller, e.g. `run_leg`'s first attempt)."""
    last: RouterError | None = None
    if failed is not None:
        last = _retry_or_raise(req, failed, first - 1, max_retries, excluded, metrics)
    for attempt in range(first, max_retries + 1):
        if attempt:
            await asyncio.sleep(backoff_s(attempt, retry_backoff_s))
        try:
            return await run(attempt_request(req, attempt) if fresh_ids else req, excluded)
        except NoEndpointAvailable as exc:
            # No other engine left: the client hears why the last attempt failed, unless
            # the request's LoRA adapter is what no engine left can serve (that says more).
            if last is None or isinstance(exc, AdapterUnavailable | AdapterLoadFailed):
                raise
            raise last from None
        except LegFailure as failure:
            last = _retry_or_raise(req, failure, attempt, max_retries, excluded, metrics)
    raise AssertionError("unreachable")


def _retry_or_raise(req: ClientRequest, failure: LegFailure, attempt: int, max_retries: int,
                    excluded: Exclusions, metrics: RouterMetrics) -> RouterError:
    """After attempt `attempt` failed: raise the engine's error when it may not be retried
    (or no retry is left), else exclude the engine, count the retry and return the error.

    An engine that answered 404 to a LoRA adapter it was believed to hold (unloaded since
    the last probe) is not to blame and not excluded: it stops counting as a holder, so the
    next attempt goes to another holder, or loads the adapter (`load_on_demand`; maybe
    onto the same engine), or is refused (503 naming the adapter)."""
    gone = _adapter_gone(req, failure)
    if gone:
        req.adapter.forget(failure.ep)
    elif not note_failure(failure.role, failure.ep, failure.error):
        raise failure.error from None
    if attempt == max_retries:
        if gone:  # say what is missing, not "the engine refused the route"
            raise AdapterUnavailable(f"engine {failure.ep.url} no longer holds LoRA adapter "
                                     f"`{req.adapter.name}` and no retry is left",
                                     param="model") from None
        raise failure.error from None
    if not gone:
        excluded.of(failure.role).append(failure.ep)
    if failure.role == "prefill" and isinstance(failure.error, EngineUnavailable):
        excluded.unreachable_prefill.append(failure.ep)
    if failure.pair is not None:
        excluded.avoid_prefill.append(failure.pair)
    metrics.child(metrics.retries, failure.role).inc()
    log.warning("request %s: %s leg failed on %s (%s); retrying on "
                "another engine", req.request_id, failure.role, failure.ep.key,
                failure.error.message)
    return failure.error


def _adapter_gone(req: ClientRequest, failure: LegFailure) -> bool:
    """Whether the leg failed because its engine does not serve the request's adapter."""
    error = failure.error
    return req.adapter is not None and isinstance(error, EngineMisconfigured) \
        and error.engine_status == 404


class PullInstead(Exception):  # noqa: N818 -- a signal, not an error
    """This request cannot run in the notify/push flow here; the pull flow serves it, or
    with `decode_alone` (every prefill engine unreachable for it) a decode engine alone."""

    def __init__(self, *, decode_alone: bool = False) -> None:
        super().__init__()
        self.decode_alone = decode_alone


async def choose_prefill(pool: EndpointPool, selector: Selector, ctx: PickContext,
                         ex: Exclusions) -> Endpoint:
    """A prefill engine not excluded (one only avoided when no other is left); `PullInstead`
    when every prefill engine is down, or every one the pool still counts healthy is one
    this request found unreachable (a P killed mid-leg drops the connection while the
    health probes still count it, as the pull flow knows): the pull flow then serves the
    request on a decode engine alone, counted there."""
    try:
        if ex.avoid_prefill:
            try:
                return await choose(pool, "prefill", selector, ctx,
                                    exclude=ex.prefill + ex.avoid_prefill)
            except NoEndpointAvailable:
                pass
        return await choose(pool, "prefill", selector, ctx, exclude=ex.prefill)
    except NoEndpointAvailable:
        down = {ep.key for ep in ex.unreachable_prefill}
        if all(ep.key in down for ep in pool.healthy("prefill")):
            raise PullInstead(decode_alone=True) from None
        raise


async def run_or_pull(
    req: ClientRequest, run: Callable[[ClientRequest, Exclusions], Awaitable[T]],
    parts: FlowParts, pull: Callable[[ClientRequest, bool], Awaitable[T]],
) -> T:
    """A notify/push flow's `run`: `with_failover`, or `pull(req, decode_alone)` (the pull
    flow's fallback) when no prefill engine is healthy or an attempt raised `PullInstead`."""
    if not parts.pool.healthy("prefill"):
        return await pull(req, False)
    try:
        return await with_failover(req, run, max_retries=parts.max_retries,
                                   retry_backoff_s=parts.retry_backoff_s, metrics=parts.metrics)
    except PullInstead as instead:
        return await pull(req, instead.decode_alone)


async def run_leg(
    parts: FlowParts, role: Role, req: ClientRequest, call: Callable[[Endpoint], Awaitable[T]],
    *, reuse: Callable[[], bool] | None = None, stream: bool = False,
    first: Endpoint | None = None,
) -> T:
    """One leg on a `role` engine through `with_failover`: choose (skipping engines that
    failed this request) → `call` → the breaker's verdict → another engine. When no untried
    engine is left and `reuse()` says the next body differs (decode without the KV params a
    dead P could not serve), an engine already tried may serve it. A stream's success is
    recorded when it ends (the engines' stream listener), not here. `first`: the engine of
    the first attempt, chosen earlier by the caller."""
    ctx = PickContext.of(req)
    policy = parts.policies[role]
    # The first attempt runs here, outside the retry loop (no closure, no loop frames):
    # most legs need no other. Nothing was tried yet, so a `NoEndpointAvailable` from
    # `choose` goes straight to the caller, as the loop's first attempt would send it.
    ep = first if first is not None else await choose(parts.pool, role, policy, ctx)
    try:
        result = await call(ep)
    except RouterError as exc:
        failed = LegFailure(role, ep, exc)
    else:
        if not stream:
            ep.health.record_success()
        req.served_by[role] = ep.key
        return result

    async def attempt(r: ClientRequest, ex: Exclusions) -> T:
        tried = ex.of(role)
        try:
            ep = await choose(parts.pool, role, policy, ctx, exclude=tried)
        except NoEndpointAvailable:
            if not tried or reuse is None or not reuse():
                raise
            ep = await choose(parts.pool, role, policy, ctx)
        try:
            result = await call(ep)
        except RouterError as exc:
            raise LegFailure(role, ep, exc) from None
        if not stream:
            ep.health.record_success()
        r.served_by[role] = ep.key
        return result

    return await _failover_from(1, failed, req, attempt, Exclusions(),
                                max_retries=parts.max_retries,
                                retry_backoff_s=parts.retry_backoff_s,
                                metrics=parts.metrics, fresh_ids=False)
