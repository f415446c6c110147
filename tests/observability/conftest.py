"""A live 1P1D cluster with JSON logs, served a few requests before the tests read it."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.e2e.cluster import Cluster, start_cluster

CLIENT_ID = "obs-client-id-1"
EXTRA: list[str] = []


@pytest.fixture(scope="package")
def cluster(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    c = start_cluster(tmp_path_factory.mktemp("obs"), tiny_model_dir, extra=EXTRA)
    try:
        body = {"model": "tiny", "prompt": "Hello there", "max_tokens": 5, "temperature": 0,
                "ignore_eos": True}
        plain = httpx.post(c.router + "/v1/completions", json=body, timeout=120,
                           headers={"X-Request-Id": CLIENT_ID})
        assert plain.status_code == 200, plain.text
        with httpx.stream("POST", c.router + "/v1/completions", timeout=120,
                          json={**body, "stream": True}) as streamed:
            assert streamed.status_code == 200
            assert any(line == "data: [DONE]" for line in streamed.iter_lines())
        bad = httpx.post(c.router + "/v1/completions", json={"model": "nope", "prompt": "x"},
                         timeout=30)
        assert bad.status_code == 404
        yield c
    finally:
        c.stop()
