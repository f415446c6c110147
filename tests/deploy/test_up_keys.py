"""`pdgate up` is secure by default: its engines require the cluster's engine key (generated
for the cluster, kept in a 0600 file of the log dir, never on a command line), the router's
legs carry it, and `--api-key` makes the router require a client key. A real cluster."""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.e2e.cluster import Cluster, child_pids, start_cluster

pytestmark = pytest.mark.slow

CLIENT_KEY = "client-key-for-up-0001"


@pytest.fixture(scope="module")
def keyed(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    c = start_cluster(tmp_path_factory.mktemp("up-keys"), tiny_model_dir, engine_key=True,
                      extra=["--api-key", CLIENT_KEY])
    try:
        yield c
    finally:
        c.stop()


def engine_key(c: Cluster) -> str:
    path = c.log_dir / "engine-api-key"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    key = path.read_text()
    assert len(key) >= 32
    return key


def test_engines_refuse_callers_without_the_clusters_key(keyed: Cluster) -> None:
    key = engine_key(keyed)
    body = {"model": "tiny", "prompt": "Hello", "max_tokens": 2}
    for url in keyed.prefill + keyed.decode:
        for auth in (None, CLIENT_KEY, "wrong-key-0123456789"):
            headers = {"Authorization": f"Bearer {auth}"} if auth else {}
            reply = httpx.post(url + "/v1/completions", json=body, headers=headers, timeout=60)
            assert reply.status_code == 401, (url, auth, reply.text)
        for method, path, payload in (("POST", "/v1/kv/reserve", {"num_tokens": 16}),
                                      ("POST", "/v1/kv/abort", {"request_id": "x"}),
                                      ("GET", "/debug/kv_transfers", None)):
            reply = httpx.request(method, url + path, json=payload, timeout=10)
            assert reply.status_code == 401, (url, path, reply.text)
        reply = httpx.post(url + "/v1/completions", json=body, timeout=60,
                           headers={"Authorization": f"Bearer {key}"})
        assert reply.status_code == 200, reply.text
        assert httpx.get(url + "/health", timeout=10).status_code == 200  # probes stay open


def test_the_routers_legs_carry_the_key_and_clients_need_theirs(keyed: Cluster) -> None:
    body = {"model": "tiny", "prompt": "Hello keyed cluster", "max_tokens": 4,
            "ignore_eos": True}
    assert httpx.post(keyed.router + "/v1/completions", json=body,
                      timeout=60).status_code == 401
    reply = httpx.post(keyed.router + "/v1/completions", json=body, timeout=120,
                       headers={"Authorization": f"Bearer {CLIENT_KEY}"})
    assert reply.status_code == 200, reply.text
    assert reply.headers["x-pdgate-prefill-engine"] == keyed.prefill[0]  # both legs ran
    assert reply.headers["x-pdgate-decode-engine"] == keyed.decode[0]
    assert reply.json()["usage"]["completion_tokens"] == 4


def test_no_key_is_on_a_command_line(keyed: Cluster) -> None:
    key = engine_key(keyed).encode()
    children = child_pids(keyed.proc.pid)
    assert len(children) == 3  # two engines and the router
    # The parent's argv has what the user typed (--api-key), never the generated key.
    assert key not in Path(f"/proc/{keyed.proc.pid}/cmdline").read_bytes()
    for pid in children:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        assert key not in cmdline and CLIENT_KEY.encode() not in cmdline, pid
    assert os.environ.get("PDGATE_ENGINE_API_KEY") is None  # nothing leaked into ours
