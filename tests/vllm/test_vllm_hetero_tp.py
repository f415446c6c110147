"""Heterogeneous tensor parallelism with real vLLM engines in pull mode: a prefill engine
with `--tensor-parallel-size 2` in front of a TP 1 decode engine, and the reverse.

vLLM maps the KV heads between the two layouts itself (its NIXL connector's TP mapping,
from the `tp_size` in P's `kv_transfer_params`); the router passes P's params through
untouched. One TP 2 engine (two workers, bound to cores 0 and 1) serves as P for the
session's TP 1 decode engine, then as D behind the session's TP 1 prefill engine. Push mode
is not covered here (docs/vllm.md).

Run by `make test-vllm-tp`, not by `make test-vllm` (CI): TP 2 prefill -> TP 1 decode
passed there once and timed out once in the whole suite, the TP 1 decode engine's READ from
the two TP 2 workers finishing minutes late, after P's lease ran out (docs/vllm.md). The TP 2
engine keeps nixl's busy progress thread (with the delay it failed the same way)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.vllm.conftest import ENGINE_START_TIMEOUT_S, VllmCluster
from tests.vllm.processes import Proc, start_vllm, wait_ready
from tests.vllm.test_vllm_pd import complete, kv_sources, unique_prompt

pytestmark = [pytest.mark.vllm, pytest.mark.vllm_tp, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def tp2(vllm_cluster: VllmCluster) -> Iterator[Proc]:
    c = vllm_cluster
    engine = start_vllm(c.python, c.model_dir, "TP2", c.log_dir, core="0|1",
                        extra_args=["--tensor-parallel-size", "2"], busy_progress=True)
    try:
        wait_ready([engine], "/health", ENGINE_START_TIMEOUT_S)
        yield engine
    finally:
        engine.stop()


def check_pd(c: VllmCluster, router: str, decode: str) -> None:
    """Greedy output through `router` equals the colocated REF engine's, and `decode`
    loaded the whole prompt over NIXL instead of computing it."""
    external0, local0 = kv_sources(decode)
    for words in (12, 60):
        prompt = unique_prompt(words)
        via_router = complete(router, prompt, 12)
        colocated = complete(c.ref.url, prompt, 12)
        assert via_router.choices[0].text == colocated.choices[0].text
    external1, local1 = kv_sources(decode)
    assert external1 > external0
    assert local1 == local0


def test_tp2_prefill_engine_feeds_a_tp1_decode_engine(vllm_cluster: VllmCluster,
                                                       tp2: Proc) -> None:
    c = vllm_cluster
    router = c.start_router("router-tp2-p", [tp2.url], [c.d.url])
    check_pd(c, router.url, c.d.url)


def test_tp1_prefill_engine_feeds_a_tp2_decode_engine(vllm_cluster: VllmCluster,
                                                       tp2: Proc) -> None:
    c = vllm_cluster
    router = c.start_router("router-tp2-d", [c.p.url], [tp2.url])
    check_pd(c, router.url, tp2.url)
