"""`--log-format json` on a real router and real shims (`pdgate up`): every router line is
one JSON object, uvicorn's own lines included; each request gets one access line with what
an operator asks first; the request id is on it."""

from __future__ import annotations

import json
import time
from typing import Any

import pytest

from tests.e2e.cluster import Cluster
from tests.observability.conftest import CLIENT_ID, Served

pytestmark = pytest.mark.slow

ACCESS_FIELDS = {"method", "path", "status", "duration_s", "request_id", "client_request_id",
                 "model", "mode", "fallback", "ttft_s", "prompt_tokens", "completion_tokens",
                 "prefill_engine", "decode_engine"}


def lines(cluster: Cluster, name: str) -> list[dict[str, Any]]:
    out = []
    for raw in (cluster.log_dir / f"{name}.log").read_text().splitlines():
        try:
            out.append(json.loads(raw))
        except json.JSONDecodeError:
            pytest.fail(f"{name}.log: not a JSON line: {raw!r}")
    return out


def access_lines(cluster: Cluster) -> list[dict[str, Any]]:
    deadline = time.monotonic() + 10  # the streamed request's line follows its last byte
    while True:
        found = [x for x in lines(cluster, "router") if x.get("access")
                 and x["path"] == "/v1/completions"]
        if len(found) >= 3 or time.monotonic() > deadline:
            return found
        time.sleep(0.1)


def test_every_router_line_is_json_uvicorn_included(cluster: Cluster) -> None:
    got = lines(cluster, "router")
    assert all({"ts", "level", "logger", "msg"} <= x.keys() for x in got)
    assert any(x["logger"].startswith("uvicorn") and "Uvicorn running" in x["msg"]
               for x in got)


def test_one_access_line_per_request_with_its_ids_and_engines(served: Served) -> None:
    c = served.cluster
    found = access_lines(c)
    assert [x["status"] for x in found] == [200, 200, 404]
    assert all(ACCESS_FIELDS <= x.keys() and x["level"] == "info" for x in found)
    plain, streamed, missing = found
    assert plain["client_request_id"] == CLIENT_ID
    assert plain["request_id"] == served.plain.headers["x-pdgate-request-id"]
    assert streamed["request_id"] == served.streamed_id
    assert streamed["client_request_id"] is None
    for line in (plain, streamed):
        assert (line["prefill_engine"], line["decode_engine"]) == (c.prefill[0], c.decode[0])
        assert line["mode"] == "notify" and line["method"] == "POST"
        assert (line["model"], line["completion_tokens"]) == ("tiny", 5)
        assert line["prompt_tokens"] > 0 and line["fallback"] is None
        assert 0 < line["duration_s"] < 120
    assert missing["request_id"] and missing["prefill_engine"] is None


def test_probes_are_not_access_logged_at_info(cluster: Cluster) -> None:
    assert not any(x.get("access") and x["path"] in ("/ready", "/metrics")
                   for x in lines(cluster, "router"))


def test_shim_lines_are_json_too(cluster: Cluster) -> None:
    got = [json.loads(raw) for raw in (cluster.log_dir / "decode-0.log").read_text()
           .splitlines() if raw.startswith("{")]
    assert any(x["logger"] == "engine_shim" and x["msg"].startswith("serving ") for x in got)
    assert any(x["logger"].startswith("uvicorn") for x in got)
