"""A live 1P1D cluster (`pdgate up`, JSON logs) that served a few requests before the tests
read its metrics and logs."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.e2e.cluster import Cluster, start_cluster

CLIENT_ID = "obs-client-id-1"
NOTIFY_SECRET = "observability-test-secret"


@dataclass
class Served:
    """The cluster and what its router answered to the fixture's requests."""

    cluster: Cluster
    plain: httpx.Response  # non-streaming, with the client's X-Request-Id
    streamed_id: str  # X-Pdgate-Request-Id of the streamed request


@pytest.fixture(scope="package")
def served(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    # Notify mode: the router then also runs its KV-ready proxy, whose metrics the
    # Grafana dashboard reads too.
    c = start_cluster(tmp_path_factory.mktemp("obs"), tiny_model_dir, extra=[
        "--log-format", "json", "--pd-mode", "notify", "--notify-secret", NOTIFY_SECRET])
    try:
        body = {"model": "tiny", "prompt": "Hello there", "max_tokens": 5, "temperature": 0,
                "ignore_eos": True}
        plain = httpx.post(c.router + "/v1/completions", json=body, timeout=120,
                           headers={"X-Request-Id": CLIENT_ID})
        assert plain.status_code == 200, plain.text
        # The stream asks for its usage chunk: streams without one are not counted.
        with httpx.stream("POST", c.router + "/v1/completions", timeout=120, json={
                **body, "stream": True, "stream_options": {"include_usage": True}}) as streamed:
            assert streamed.status_code == 200
            got = list(streamed.iter_lines())
            assert "data: [DONE]" in got
            assert any('"usage":{' in line for line in got)
        bad = httpx.post(c.router + "/v1/completions", json={"model": "nope", "prompt": "x"},
                         timeout=30)
        assert bad.status_code == 404
        yield Served(c, plain, streamed.headers["x-pdgate-request-id"])
    finally:
        c.stop()


@pytest.fixture(scope="package")
def cluster(served: Served) -> Cluster:
    return served.cluster
