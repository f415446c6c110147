"""A router process started with `--prefill-dp-size 2 --decode-dp-size 2` in front of fake
vLLM engines serving two DP ranks each: legs pinned per rank, and the rank shown where an
operator looks (metrics, the JSON access log, the dashboard, `/admin/engines`)."""

from __future__ import annotations

import asyncio
import json
import os
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from pdgate.router.dp_ranks import RANK_HEADER
from tests.router.conftest import MODEL, wait_until_ready
from tests.router.fake_engine import FakeEngine

ROOT = Path(__file__).resolve().parents[2]
ADMIN = {"Authorization": "Bearer admin-secret-1"}


@pytest.fixture
async def engines() -> AsyncIterator[Callable[..., Awaitable[FakeEngine]]]:
    made: list[FakeEngine] = []

    async def make(**knobs: Any) -> FakeEngine:
        engine = FakeEngine(**knobs)
        await engine.start()
        made.append(engine)
        return engine

    yield make
    for engine in made:
        await engine.stop()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def test_a_router_process_routes_and_shows_dp_ranks(
    engines: Callable[..., Awaitable[FakeEngine]],
) -> None:
    p = await engines(engine_id="P", dp_size=2)
    d = await engines(engine_id="D", dp_size=2, delay_s=0.1)
    port = _free_port()
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "pdgate.router", "--model", MODEL, "--prefill", p.url,
        "--prefill-dp-size", "2", "--decode", d.url, "--decode-dp-size", "2",
        "--port", str(port), "--log-format", "json", "--admin-api-key", "admin-secret-1",
        cwd=ROOT, stderr=asyncio.subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=30) as c:
            await wait_until_ready(c, proc)
            answers = await asyncio.gather(*(c.post("/v1/completions", json={
                "model": MODEL, "prompt": f"Hello {i}", "max_tokens": 3}) for i in range(6)))
            assert all(a.status_code == 200 for a in answers)
            metrics = (await c.get("/metrics")).text
            state = (await c.get("/dashboard/state", headers=ADMIN)).json()
            admin = (await c.get("/admin/engines", headers=ADMIN)).json()
    finally:
        if proc.returncode is None:
            proc.terminate()
        assert proc.stderr is not None
        log = (await proc.stderr.read()).decode()
        assert await asyncio.wait_for(proc.wait(), 30) == 0
    assert {r.rank for r in p.prefills} == {0, 1} and {r.rank for r in d.decodes} == {0, 1}
    for rec in p.requests + d.requests:
        assert rec.headers[RANK_HEADER] == str(rec.rank)
    for role, url in (("prefill", p.url), ("decode", d.url)):
        for rank in (0, 1):
            assert f'pdgate_engine_in_flight{{engine="{url}@{rank}",role="{role}"}}' in metrics
    assert {e["url"] for e in state["engines"]} == {
        f"{p.url}@0", f"{p.url}@1", f"{d.url}@0", f"{d.url}@1"}
    assert sorted((e["url"], e["rank"]) for e in admin["engines"]) == sorted(
        [(p.url, 0), (p.url, 1), (d.url, 0), (d.url, 1)])
    lines = [json.loads(line) for line in log.splitlines() if line.startswith("{")]
    served = {(x.get("prefill_engine"), x.get("decode_engine")) for x in lines
              if x.get("prefill_engine")}
    assert len(served) >= 2 and all(
        pe.startswith(f"{p.url}@") and de.startswith(f"{d.url}@") for pe, de in served)
