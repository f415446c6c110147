"""Log lines carry the current request's ids in both formats; good news is not a warning."""

from __future__ import annotations

import io
import json
import logging
import sys
import warnings
from collections.abc import Iterator

import pytest
from prometheus_client import CollectorRegistry

from pdgate.common.log_format import configure_logging
from pdgate.router import request_context
from pdgate.router.health import EngineHealth, HealthSettings
from pdgate.router.logs import request_fields, setup_logging
from pdgate.router.metrics import RouterMetrics
from pdgate.router.pool import EndpointPool


@pytest.fixture
def stderr() -> Iterator[io.StringIO]:
    root = logging.getLogger()
    saved = (list(root.handlers), root.level)
    yield io.StringIO()
    root.handlers[:] = saved[0]
    root.setLevel(saved[1])


def log_in_request(text: str) -> None:
    token = request_context.open_record(request_context.RequestRecord("POST", "/v1/x"))
    try:
        request_context.bind_ids("abc123", "client-7")
        logging.getLogger("pdgate.router.test").warning(text, extra={"fields": {"n": 1}})
    finally:
        request_context.close_record(token)
    logging.getLogger("pdgate.router.test").warning("outside")


def test_json_lines_carry_the_request_ids(stderr: io.StringIO) -> None:
    configure_logging("info", "json", request_fields, stderr)
    log_in_request("inside")
    inside, outside = (json.loads(x) for x in stderr.getvalue().splitlines())
    assert inside["msg"] == "inside" and inside["level"] == "warning"
    assert (inside["request_id"], inside["client_request_id"], inside["n"]) == (
        "abc123", "client-7", 1)
    assert "request_id" not in outside and outside["ts"].endswith("Z")


def test_text_lines_carry_the_request_ids(stderr: io.StringIO) -> None:
    configure_logging("info", "text", request_fields, stderr)
    log_in_request("inside")
    inside, outside = stderr.getvalue().splitlines()
    assert inside.endswith("inside request_id=abc123 client_request_id=client-7 n=1")
    assert outside.endswith("router.test: outside")


def test_unknown_format_is_refused() -> None:
    with pytest.raises(ValueError, match="text, json"):
        configure_logging("info", "xml", request_fields)


def test_breaker_closing_is_info_and_opening_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    now = [0.0]
    health = EngineHealth(HealthSettings(eject_after=1, open_s=1.0), "P0", clock=lambda: now[0])
    with caplog.at_level(logging.INFO, logger="pdgate.router.health"):
        health.record_failure()
        now[0] = 2.0
        health.record_success()
    assert [(r.levelname, "OPEN" in r.getMessage()) for r in caplog.records] == [
        ("WARNING", True), ("INFO", False)]


def test_an_engine_still_starting_is_info_and_a_failing_one_a_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    pool = EndpointPool(["http://127.0.0.1:9"], [], RouterMetrics.create(CollectorRegistry()))
    (ep,) = pool.all()
    with caplog.at_level(logging.INFO, logger="pdgate.router.pool"):
        ep.set_healthy(False)  # the first probe, while the engine loads its model
        ep.set_healthy(True)
        ep.set_healthy(False)  # it was up: now that is a failure
    assert [(r.levelname, r.getMessage().split(" is now ")[1]) for r in caplog.records] == [
        ("INFO", "not ready yet (starting)"), ("INFO", "healthy"), ("WARNING", "UNHEALTHY")]


def test_python_warnings_become_log_lines_in_the_router_format(
    stderr: io.StringIO, monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(sys, "stderr", stderr)
    try:
        setup_logging("info", "json")
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.warn("an old API", DeprecationWarning, stacklevel=1)
    finally:
        logging.captureWarnings(False)
    (line,) = (json.loads(x) for x in stderr.getvalue().splitlines())
    assert line["logger"] == "py.warnings" and "an old API" in line["msg"]
