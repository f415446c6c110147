"""When tracing is on, and what the router does when it is asked for without the SDK."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import pytest

from pdgate.common.tracing import tracing_requested
from pdgate.router.config import RouterConfig
from pdgate.router.http.app import create_app


@pytest.mark.parametrize(("endpoint", "env", "on"), [
    (None, {}, False),
    ("http://127.0.0.1:4318/v1/traces", {}, True),
    (None, {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318"}, True),
    (None, {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://c:4318/v1/traces"}, True),
    ("http://127.0.0.1:4318/v1/traces", {"OTEL_SDK_DISABLED": "true"}, False),
    (None, {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318", "OTEL_TRACES_EXPORTER": "none"},
     False),
])
def test_tracing_is_off_unless_asked_for(endpoint: str | None, env: dict[str, str],
                                         on: bool) -> None:
    assert tracing_requested(endpoint, env) is on


def test_asking_for_traces_without_the_sdk_warns_and_serves_untraced(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setitem(sys.modules, "opentelemetry.sdk.trace", None)  # import fails
    config = RouterConfig(model=str(tiny_model_dir), prefill=["http://127.0.0.1:1"],
                          decode=["http://127.0.0.1:2"],
                          otlp_traces_endpoint="http://127.0.0.1:4318/v1/traces")
    with caplog.at_level(logging.WARNING):
        create_app(config)  # no ConfigError: tracing never stops a router
    assert [r.getMessage() for r in caplog.records if "pdgate[otel]" in r.getMessage()]
