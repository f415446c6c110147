"""`--warmup-tokens N`: the shim runs one N-token prompt before /health answers (on by
default on CUDA only), so its first real request does not pay the device's first use. Here,
on CPU, what a user sees of it: once healthy, the engine has already computed that prompt
(`pdgate_shim_prompt_tokens_total`) and holds nothing (no running or waiting request), and the
first request is served as usual."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from pdgate.engine_shim.warmup import default_warmup_tokens
from tests.engine_shim.process import MODEL, shim_process


def _metric(page: str, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in page.splitlines()
               if line.startswith(name + "{") or line.startswith(name + " "))


@pytest.mark.parametrize(("flag", "computed"), [((), 0.0), (("--warmup-tokens", "48"), 48.0)])
def test_a_warm_engine_computed_one_prompt_before_it_answered_health(
        tiny_model_dir: Path, flag: tuple[str, ...], computed: float) -> None:
    with shim_process(tiny_model_dir, "--no-kv-transfer", *flag) as shim:
        page = httpx.get(shim.url + "/metrics", timeout=10).text
        assert _metric(page, "pdgate_shim_prompt_tokens_total") == computed
        assert _metric(page, "vllm:num_requests_running") == 0.0
        assert _metric(page, "vllm:num_requests_waiting") == 0.0
        r = httpx.post(shim.url + "/v1/completions", timeout=60, json={
            "model": MODEL, "prompt": "after the warm-up", "max_tokens": 3})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 3


def test_only_gpu_engines_warm_up_by_default() -> None:
    assert default_warmup_tokens("cuda") == default_warmup_tokens("cuda:1") == 1024
    assert default_warmup_tokens("cpu") == 0
