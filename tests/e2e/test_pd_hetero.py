"""Host staging and heterogeneous block sizes end to end: `pdgate up` with
`--engine-arg=--kv-buffer-device --engine-arg=cpu` (NIXL moves a host mirror; blocks are
copied device <-> host around each transfer) and with a prefill block size different from the
decode one (`--prefill-engine-arg` / `--decode-engine-arg`), in pull, notify and push modes.
Disaggregated greedy output must equal colocated output token for token, D must hold exactly
P's prompt KV (digests over the prompt's tokens), the bytes moved must be what the mapping
says, and every pool must come back full."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from pdgate.engine_shim.kv_layout import LAYOUTS
from tests.e2e.cluster import Cluster, burst, complete, metric, start_cluster, wait_pools_full

pytestmark = pytest.mark.slow

PROMPTS = [
    "Hello",
    "The quick brown fox jumps over the lazy dog.",
    "Paged attention stores keys and values in fixed size blocks. " * 12,
]
LAYERS = 2
TOKEN_BYTES = 2 * 16 * 4  # tiny model: 2 kv heads x head_dim 16 x float32, one layer's K or V
STAGING = ["--engine-arg=--kv-buffer-device", "--engine-arg=cpu"]


@dataclass(frozen=True)
class Setup:
    mode: str
    prefill_block_size: int
    decode_block_size: int
    staging: bool
    kv_layout: str = "block"  # every engine's --kv-layout

    @property
    def args(self) -> list[str]:
        argv = ["--pd-mode", self.mode, f"--engine-arg=--kv-layout={self.kv_layout}"]
        argv.append(f"--prefill-engine-arg=--block-size={self.prefill_block_size}")
        argv.append(f"--decode-engine-arg=--block-size={self.decode_block_size}")
        return argv + (STAGING if self.staging else [])


SETUPS = {
    "pull-staging": Setup("pull", 4, 4, staging=True),
    "notify-staging": Setup("notify", 4, 4, staging=True),
    "push-staging": Setup("push", 4, 4, staging=True),
    "pull-p4-d8": Setup("pull", 4, 8, staging=False),
    "notify-p8-d4": Setup("notify", 8, 4, staging=False),
    "push-p6-d4-staging": Setup("push", 6, 4, staging=True),
    # The layer-major layout (the default is block-major): mapped regions and staging copies.
    "layer-pull-p4-d8-staging": Setup("pull", 4, 8, staging=True, kv_layout="layer"),
}


@dataclass
class Running:
    cluster: Cluster
    setup: Setup


@pytest.fixture(scope="module", params=list(SETUPS), ids=list(SETUPS))
def running(request: pytest.FixtureRequest, tiny_model_dir: Path,
            tmp_path_factory: pytest.TempPathFactory) -> Iterator[Running]:
    setup = SETUPS[request.param]
    c = start_cluster(tmp_path_factory.mktemp(request.param), tiny_model_dir,
                      extra=setup.args)
    yield Running(c, setup)
    c.stop()


def _moved(r: Running) -> float:
    """NIXL bytes: D's READs in pull mode, P's WRITEs in notify/push."""
    if r.setup.mode == "pull":
        return metric(r.cluster.decode[0], "pdgate_shim_kv_transfer_bytes_total", 'op="read"')
    return metric(r.cluster.prefill[0], "pdgate_shim_kv_transfer_bytes_total", 'op="write"')


def _expected_bytes(s: Setup, prompt_tokens: int) -> int:
    if s.prefill_block_size == s.decode_block_size:  # whole blocks, as before
        blocks = -(-prompt_tokens // s.prefill_block_size)
        return blocks * s.prefill_block_size * LAYERS * 2 * TOKEN_BYTES
    return prompt_tokens * LAYERS * 2 * TOKEN_BYTES  # mapped: exactly the prompt's tokens


@pytest.mark.parametrize("prompt", PROMPTS, ids=["1-block", "3-blocks", "many-blocks"])
def test_greedy_output_equals_colocated_and_moves_the_expected_bytes(
        running: Running, prompt: str) -> None:
    c = running.cluster
    before = _moved(running)
    via_router = complete(c.router, prompt)
    moved = _moved(running) - before
    colocated = complete(c.decode[0], prompt)
    assert via_router["choices"][0]["text"] == colocated["choices"][0]["text"]
    n = colocated["usage"]["prompt_tokens"]
    assert via_router["usage"]["prompt_tokens"] == n
    assert moved == _expected_bytes(running.setup, n)


def test_decode_device_holds_exactly_the_prefill_prompt_kv(running: Running) -> None:
    """Digests of the prompt's token slots on P's and D's devices (not the staging mirrors):
    equal only if every copy and the mapping put each byte in the right place."""
    c = running.cluster
    resp = httpx.post(c.router + "/v1/completions", timeout=120,
                      json={"model": "tiny", "prompt": PROMPTS[2], "max_tokens": 4})
    assert resp.status_code == 200, resp.text
    rid = resp.headers["X-Pdgate-Request-Id"]  # engines know the request by the router's id
    held = httpx.get(c.prefill[0] + "/debug/kv_transfers", timeout=5).json()["transfers"]
    got = httpx.get(c.decode[0] + "/debug/kv_transfers", timeout=5).json()["transfers"]
    p = next(t for t in held if t["request_id"].startswith(rid))
    d = next(t for t in got if t["request_id"].startswith(rid))
    assert p["role"] == "prefill" and d["role"].startswith("decode")
    assert p["digest"] and p["digest"] == d["digest"]


def test_engines_run_the_requested_kv_layout(running: Running) -> None:
    want = LAYOUTS[running.setup.kv_layout]
    for url in running.cluster.prefill + running.cluster.decode:
        info = httpx.post(url + "/v1/kv/info", json={}, timeout=5).json()
        assert info["kv_layout"] == want


def test_staging_copies_are_measured_on_both_sides(running: Running) -> None:
    c = running.cluster
    name = "pdgate_shim_kv_staging_seconds_count"
    to_host = metric(c.prefill[0], name, 'direction="to_host"')
    to_device = metric(c.decode[0], name, 'direction="to_device"')
    if running.setup.staging:
        assert to_host >= 4 and to_device >= 4  # one per disaggregated request so far
        assert metric(c.decode[0], "pdgate_shim_kv_staging_bytes_total") > 0
    else:
        assert to_host == to_device == 0


def test_block_pools_return_to_full_after_a_burst(running: Running) -> None:
    c = running.cluster
    asyncio.run(burst(c, PROMPTS, full=6, abandoned=3, first_max_tokens=4,
                      extra={"temperature": 0}))
    wait_pools_full(c)
    # Nothing fell back to recomputing the prompt: every transfer (and copy) succeeded.
    for url in c.prefill + c.decode:
        assert metric(url, "pdgate_shim_requests_total", 'status="recompute"') == 0, c.logs()
    assert metric(c.router, "pdgate_fallbacks_total") == 0
