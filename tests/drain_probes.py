"""Watching a `--workers` router drain from outside, as a load balancer's probe does: fresh
connections (the kernel spreads them over the workers), each answer naming its worker."""

from __future__ import annotations

import time

import httpx

__all__ = ["wait_for_drain"]


def wait_for_drain(url: str, sent: float, workers: frozenset[str] = frozenset({"0", "1"}),
                   within_s: float = 5.0) -> None:
    """Return once 20 probes of `url` in a row answered 503 "draining", every one of
    `workers` among them. A probe answered otherwise fails the test when it was sent more
    than `within_s` after `sent` (the signal), else starts the run again. Judged by when a
    probe was sent: on a loaded machine a slow answer to a probe sent before a worker's
    flip is not that worker's delay. The parent signals its workers one after the other."""
    in_a_row: list[str] = []
    while len(in_a_row) < 20 or set(in_a_row) != workers:
        asked = time.monotonic()
        resp = httpx.get(url, headers={"Connection": "close"}, timeout=5.0)
        if resp.status_code == 503:
            assert resp.json()["status"] == "draining", resp.text
            in_a_row.append(resp.headers["x-pdgate-worker"])
            continue
        assert asked - sent < within_s, f"{url} still {resp.status_code} {within_s} s after SIGTERM"
        in_a_row = []
        time.sleep(0.05)
