"""Best-effort KV aborts: telling an engine to free what it holds for a request.

One implementation for every flow: pull (P's pinned blocks when no decode leg will read
them), notify (D's reservation, P's side) and push (P's held prompt, D's registration). Each
abort is `POST /v1/kv/abort` in the background within `--kv-abort-timeout-s`, counted in
`pdgate_kv_aborts_total{result}` (ok | unsupported: e.g. vLLM has no such route | failed).
Leases and reservation TTLs on the engines remain the backstop when an abort is lost.
"""

from __future__ import annotations

import asyncio

from pdgate.router.engines.client import EngineClient
from pdgate.router.metrics import RouterMetrics

__all__ = ["Aborter"]


class Aborter:
    """Sends aborts in the background. One per app; `aclose()` waits for those in flight
    (each bounded by its deadline) so shutdown does not drop them."""

    def __init__(self, engines: EngineClient, metrics: RouterMetrics, timeout_s: float) -> None:
        self._engines = engines
        self._metrics = metrics
        self._timeout_s = timeout_s
        self._tasks: set[asyncio.Task[None]] = set()

    def abort(self, url: str, request_id: str, *, write_possible: bool = True) -> None:
        """Ask engine `url` to free what it holds for `request_id`. `write_possible=False`:
        no prefill engine was asked to write into a decode engine's reservation for it, so
        D frees that at once instead of after its landing grace."""

        async def run() -> None:
            result = await self._engines.abort_kv(url, request_id, self._timeout_s,
                                                  write_possible=write_possible)
            self._metrics.child(self._metrics.kv_aborts, result).inc()

        task = asyncio.get_running_loop().create_task(run(), name=f"kv-abort-{request_id}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def aclose(self) -> None:
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
