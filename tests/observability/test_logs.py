"""`--log-format json` on a real router and real shims (`pdgate up`): every router and shim
line is one JSON object, uvicorn's and NIXL's own lines included; each request gets one
access line with what an operator asks first; the request id is on it."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from typing import Any

import pytest

from tests.e2e.cluster import Cluster
from tests.observability.conftest import CLIENT_ID, Served

pytestmark = pytest.mark.slow

ACCESS_FIELDS = {"method", "path", "status", "duration_s", "request_id", "client_request_id",
                 "model", "mode", "fallback", "ttft_s", "prefill_s", "prompt_tokens",
                 "completion_tokens", "prefill_engine", "decode_engine"}


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
        # The P leg's round trip, within the request's.
        assert 0 < line["prefill_s"] <= line["duration_s"], line
    # A stream's first token; a whole answer shows none (its time is `duration_s`).
    assert 0 < streamed["ttft_s"] <= streamed["duration_s"]
    assert plain["ttft_s"] is None
    assert missing["request_id"] and missing["prefill_engine"] is None
    # A refused request's line says why, with the code of the error body the client got.
    assert missing["error_code"] == "model_not_found"
    assert "error_code" not in plain and "error_code" not in streamed


def test_probes_are_not_access_logged_at_info(cluster: Cluster) -> None:
    assert not any(x.get("access") and x["path"] in ("/ready", "/metrics")
                   for x in lines(cluster, "router"))


# What native code (UCX) prints itself never passes through Python's logging.
UCX_NATIVE = re.compile(r"^\[\d+\.\d+\] \[[^]]+\] .*\bUCX\b")


@pytest.mark.parametrize("engine", ["prefill-0", "decode-0"])
def test_every_shim_line_is_json_nixl_included(cluster: Cluster, engine: str) -> None:
    raw = (cluster.log_dir / f"{engine}.log").read_text().splitlines()
    got = [json.loads(line) for line in raw if not UCX_NATIVE.match(line)]
    assert all({"ts", "level", "logger", "msg"} <= x.keys() for x in got)
    assert any(x["logger"] == "pdgate.engine_shim" and x["msg"].startswith("serving ")
               for x in got)
    assert any(x["logger"].startswith("uvicorn") for x in got)
    # NIXL's Python API logs through its own stdout handler unless the shim folds it in.
    assert any(x["logger"].startswith("nixl") and "NIXL agent" in x["msg"] for x in got)


def test_shim_warnings_and_library_loggers_come_out_as_json() -> None:
    # A library that gives its logger its own handler (as transformers and nixl do on
    # import), and a Python warning: both as JSON lines once the shim's logging is set up.
    code = (
        "import logging, warnings\n"
        "from pdgate.engine_shim.logs import fold_library_loggers, setup_logging\n"
        "setup_logging('info', 'json')\n"
        "lib = logging.getLogger('transformers')\n"
        "lib.addHandler(logging.StreamHandler()); lib.propagate = False\n"
        "fold_library_loggers()\n"
        "lib.warning('from the library')\n"
        "warnings.warn('a deprecation', DeprecationWarning, stacklevel=1)\n"
    )
    out = subprocess.run([sys.executable, "-W", "always", "-c", code], capture_output=True,
                         text=True, timeout=60, check=True)
    got = [json.loads(line) for line in out.stderr.splitlines()]
    assert [(x["logger"], x["level"]) for x in got] == [
        ("transformers", "warning"), ("py.warnings", "warning")], out.stderr
    assert "a deprecation" in got[1]["msg"]
