"""Requests for the prompt's logprobs (`prompt_logprobs`, or `echo` with `logprobs`) run
on a decode engine alone: D loads the prompt's KV instead of computing the prompt, so
through P/D it has no prompt logprobs to give. Other fields stay disaggregated."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import pytest

from tests.router.conftest import MODEL, RunningRouter
from tests.router.fake_engine import FakeEngine

MakeEngine = Callable[..., Awaitable[FakeEngine]]
StartRouter = Callable[..., Awaitable[RunningRouter]]
DECISIONS = "pdgate_disagg_decisions_total"


@pytest.mark.parametrize(("fields", "disagg"), [
    ({"echo": True, "logprobs": 2}, False),
    ({"prompt_logprobs": 1}, False),
    ({"echo": True}, True),
    ({"logprobs": 2, "stop": ["x"]}, True),
    ({"echo": True, "logprobs": 0}, True),  # 0: no logprobs asked for
])
async def test_prompt_logprobs_run_on_decode_alone(
    make_engine: MakeEngine, start_router: StartRouter, fields: dict[str, object],
    disagg: bool,
) -> None:
    p, d = await make_engine(engine_id="P0"), await make_engine(engine_id="D0")
    router = await start_router([p], [d], early_first_token=False)
    resp = await router.client.post("/v1/completions", json={
        "model": MODEL, "prompt": "hi", "max_tokens": 2, **fields})
    assert resp.status_code == 200
    assert bool(p.requests) is disagg
    assert ("kv_transfer_params" in d.requests[0].body) is disagg
    for key, value in fields.items():
        assert d.requests[0].body[key] == value
    reason = "disagg" if disagg else "prompt_logprobs"
    assert router.metric(DECISIONS, {"reason": reason}) == 1
