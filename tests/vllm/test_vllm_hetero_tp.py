"""Heterogeneous tensor parallelism with real vLLM engines in pull mode: a prefill engine
with `--tensor-parallel-size 2` in front of a TP 1 decode engine, and the reverse (push
mode: test_vllm_push.py).

vLLM maps the KV heads between the two layouts itself (its NIXL connector's TP mapping,
from the `tp_size` in P's `kv_transfer_params`); the router passes P's params through
untouched. One TP 2 engine (two workers, bound to cores 0 and 1) serves as P for the
session's TP 1 decode engine, then as D behind the session's TP 1 prefill engine."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.vllm.conftest import ENGINE_START_TIMEOUT_S, VllmCluster
from tests.vllm.processes import Proc, start_vllm, wait_ready
from tests.vllm.test_vllm_pd import check_kv_over_nixl

pytestmark = [pytest.mark.vllm, pytest.mark.vllm_tp, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def tp2(vllm_cluster: VllmCluster) -> Iterator[Proc]:
    c = vllm_cluster
    engine = start_vllm(c.python, c.model_dir, "TP2", c.log_dir, core="0|0",
                        extra_args=["--tensor-parallel-size", "2"])
    try:
        wait_ready([engine], "/health", ENGINE_START_TIMEOUT_S)
        yield engine
    finally:
        engine.stop()


def test_tp2_prefill_engine_feeds_a_tp1_decode_engine(vllm_cluster: VllmCluster,
                                                       tp2: Proc) -> None:
    c = vllm_cluster
    router = c.start_router("router-tp2-p", [tp2.url], [c.d.url])
    check_kv_over_nixl(router.url, c.d.url, c.ref.url)


def test_tp1_prefill_engine_feeds_a_tp2_decode_engine(vllm_cluster: VllmCluster,
                                                       tp2: Proc) -> None:
    c = vllm_cluster
    router = c.start_router("router-tp2-d", [c.p.url], [tp2.url])
    check_kv_over_nixl(router.url, tp2.url, c.ref.url)
