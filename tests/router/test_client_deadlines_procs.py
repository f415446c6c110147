"""Client deadlines seen from outside a real router process: a client that leaves mid-upload
is one counted 499 and one access line (no traceback), and connections that have not sent
a complete request are capped (the extra ones are refused before anything is read)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from tests.router.conftest import MODEL, wait_until_ready
from tests.router.fake_engine import FakeEngine
from tests.router.test_config import free_port

MakeEngine = Callable[..., Awaitable[FakeEngine]]
ROOT = Path(__file__).parents[2]
COMPLETIONS = "/v1/completions"
BODY = {"model": MODEL, "prompt": "Hello", "max_tokens": 3}


@dataclass
class RouterProc:
    proc: asyncio.subprocess.Process
    port: int
    client: httpx.AsyncClient
    stderr: bytes = b""

    async def metric(self, name: str, labels: dict[str, str]) -> float:
        text = (await self.client.get("/metrics")).text
        want = "{" + ",".join(f'{k}="{v}"' for k, v in labels.items()) + "}"
        for line in text.splitlines():
            if line.startswith(name + want + " "):
                return float(line.rsplit(" ", 1)[1])
        return 0.0

    def log_lines(self) -> list[dict[str, Any]]:
        return [json.loads(line) for line in self.stderr.decode().splitlines()
                if line.startswith("{")]


@contextlib.asynccontextmanager
async def router_process(
    tiny_model_dir: Path, p: FakeEngine, d: FakeEngine, *flags: str
) -> AsyncIterator[RouterProc]:
    """A `python -m pdgate.router` process logging JSON lines; its stderr is in `.stderr`
    once the block ends (after a clean SIGTERM shutdown)."""
    port = free_port()
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "pdgate.router", "--model", str(tiny_model_dir),
        "--served-model-name", MODEL, "--prefill", p.url, "--decode", d.url,
        "--port", str(port), "--log-format", "json", "--log-level", "info", *flags,
        cwd=ROOT, stderr=asyncio.subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"},
    )
    running = RouterProc(proc, port, httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}"))
    try:
        await wait_until_ready(running.client, proc)
        yield running
    finally:
        await running.client.aclose()
        if proc.returncode is None:
            proc.terminate()
        _, running.stderr = await asyncio.wait_for(proc.communicate(), 30)


async def _leave_mid_upload(port: int, sent: int) -> None:
    """Announce a 1,000-byte body, send `sent` bytes of it, wait, and hang up."""
    _, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                 b"\r\nContent-Length: 1000\r\n\r\n" + b'{"prompt": "' + b"x" * sent)
    await writer.drain()
    await asyncio.sleep(0.5)
    writer.close()
    await writer.wait_closed()


async def test_a_client_that_leaves_mid_upload_is_a_counted_499_without_traceback(
    make_engine: MakeEngine, tiny_model_dir: Path
) -> None:
    p, d = await make_engine(), await make_engine()
    async with router_process(tiny_model_dir, p, d) as router:
        # Half leave after some body bytes, half before the first one.
        await asyncio.gather(*(_leave_mid_upload(router.port, 0 if i % 2 else 200)
                               for i in range(20)))
        labels = {"route": COMPLETIONS, "status": "499"}
        for _ in range(100):
            if await router.metric("pdgate_requests_total", labels) == 20:
                break
            await asyncio.sleep(0.05)
        assert await router.metric("pdgate_requests_total", labels) == 20
        assert (await router.client.post(COMPLETIONS, json=BODY)).status_code == 200
    err = router.stderr.decode()
    assert "Traceback" not in err and "ClientDisconnect" not in err, err[-3000:]
    assert not [x for x in router.log_lines() if x["level"] in ("error", "critical")]
    access = [x for x in router.log_lines() if x.get("access") and x["path"] == COMPLETIONS]
    assert sorted(x["status"] for x in access) == [200] + [499] * 20
    assert len(p.requests) == 1  # only the one complete request reached an engine


async def _answer_within(reader: asyncio.StreamReader, within_s: float) -> bytes | None:
    """What the server sent before closing, or None while it keeps the connection open."""
    try:
        async with asyncio.timeout(within_s):
            return await reader.read()
    except TimeoutError:
        return None


async def test_connections_without_a_complete_request_are_capped(
    make_engine: MakeEngine, tiny_model_dir: Path
) -> None:
    p, d = await make_engine(), await make_engine()
    async with router_process(tiny_model_dir, p, d, "--max-pending-connections", "20",
                              "--header-timeout-s", "2") as router:
        # A client whose keep-alive connection has completed a request is not pending.
        assert (await router.client.post(COMPLETIONS, json=BODY)).status_code == 200
        idle = [await asyncio.open_connection("127.0.0.1", router.port) for _ in range(20)]
        await asyncio.sleep(0.3)  # the router has accepted all twenty
        extra = [await asyncio.open_connection("127.0.0.1", router.port) for _ in range(5)]
        refused = await asyncio.gather(*(_answer_within(r, 1.0) for r, _ in extra))
        for answer in refused:  # refused at once, before the client sent anything
            assert answer is not None and answer.startswith(b"HTTP/1.1 503"), answer
            assert b'"code":"too_many_connections"' in answer
        # The twenty are still open, and the established client is still served.
        assert await asyncio.gather(*(_answer_within(r, 0.05) for r, _ in idle)) == [None] * 20
        assert (await router.client.post(COMPLETIONS, json=BODY)).status_code == 200
        # Once the idle ones hit the header deadline and close, new connections are served.
        closed = await asyncio.gather(*(_answer_within(r, 5.0) for r, _ in idle))
        assert closed == [b""] * 20
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{router.port}") as fresh:
            assert (await fresh.post(COMPLETIONS, json=BODY)).status_code == 200
        for _, writer in idle + extra:
            writer.close()
    assert "--max-pending-connections 20" in router.stderr.decode()  # said why, once
