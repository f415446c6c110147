"""Tracing configured the way clusters configure it: the standard OTEL_* variables, OTLP over
gRPC as well as HTTP, to real receivers on loopback, from real router and shim processes.
Tracing never takes a process down: asked for without the SDK, one warning and no traces."""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from pdgate.common.tracing import exporter_protocol, open_tracing, sampler_setting
from tests.observability.otlp import GrpcReceiver, HttpReceiver, Receiver, Span

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
TRACE_A = "4bf92f3577b34da6a3ce929d0e0e4736"
TRACE_B = "6cf92f3577b34da6a3ce929d0e0e4738"
CLIENT_SPAN = "00f067aa0ba902b7"
WARNING = "serving without tracing"
# Run the console script with the OpenTelemetry SDK unimportable, as in an image built
# without the otel extra (the API alone is a dependency of nothing pdgate needs).
NO_SDK = ("import sys; sys.modules['opentelemetry.sdk'] = None; "
          "from pdgate.cli import main; sys.exit(main())")
WITH_SDK = "import sys; from pdgate.cli import main; sys.exit(main())"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Proc:
    proc: subprocess.Popen[bytes]
    url: str
    log: Path

    def stop(self) -> str:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.log.read_text()


def _start(tmp: Path, argv: list[str], env: dict[str, str], *, sdk: bool = True) -> Proc:
    port = _free_port()
    clean = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    log = tmp / f"{argv[0]}-{port}.log"
    proc = subprocess.Popen(
        [sys.executable, "-c", WITH_SDK if sdk else NO_SDK, *argv, "--host", "127.0.0.1",
         "--port", str(port)],
        cwd=ROOT, stdout=log.open("wb"), stderr=subprocess.STDOUT,
        env={**clean, "HF_HUB_OFFLINE": "1", "OTEL_BSP_SCHEDULE_DELAY": "100", **env})
    started = Proc(proc, f"http://127.0.0.1:{port}", log)
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"{argv[0]} exited with {proc.returncode}:\n{log.read_text()}")
        try:
            if httpx.get(started.url + "/health", timeout=1).status_code == 200:
                return started
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    started.stop()
    pytest.fail(f"{argv[0]} not up in 90 s:\n{log.read_text()}")


StartRouter = Callable[..., Proc]


@pytest.fixture
def router(tmp_path: Path, tiny_model_dir: Path) -> Iterator[StartRouter]:
    """`router(env, sdk=True)`: a router process whose engines are not there (a request
    gets a 503, still a traced request). It waits 0.1 s for engines that will not come;
    the default 10 s start-up wait made the module's requests take 100 s."""
    started: list[Proc] = []

    def start(env: dict[str, str], *, sdk: bool = True, args: tuple[str, ...] = ()) -> Proc:
        argv = ["router", "--model", str(tiny_model_dir), "--served-model-name", "tiny",
                "--prefill", f"http://127.0.0.1:{_free_port()}", "--decode",
                f"http://127.0.0.1:{_free_port()}", "--prefill-policy", "round-robin",
                "--startup-wait-s", "0.1", *args]
        started.append(_start(tmp_path, argv, env, sdk=sdk))
        return started[-1]

    yield start
    for p in started:
        p.stop()


def _ask(url: str, trace: str | None) -> httpx.Response:
    headers = {"traceparent": f"00-{trace}-{CLIENT_SPAN}-01"} if trace else {}
    return httpx.post(url + "/v1/completions", headers=headers, timeout=30,
                      json={"model": "tiny", "prompt": "Hello", "max_tokens": 2})


def _server_span(receiver: Receiver, trace: str) -> Span:
    """The request's SERVER span (the child of the client's span), once it arrived."""
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        server = [s for s in receiver.spans if s.trace_id == trace and s.parent_id == CLIENT_SPAN]
        if server:
            assert [s.name for s in server] == ["POST /v1/completions"], server
            return server[0]
        time.sleep(0.1)
    raise AssertionError(f"no server span of {trace}: {receiver.spans}")


def test_without_the_sdk_the_router_warns_once_and_serves(router: StartRouter) -> None:
    proc = router({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4318"},
                  sdk=False)
    reply = _ask(proc.url, TRACE_A)
    assert reply.status_code == 503, reply.text  # served (no engine up), not crashed
    assert proc.proc.poll() is None
    log = proc.stop()
    warnings = [line for line in log.splitlines() if WARNING in line]
    assert len(warnings) == 1, log
    assert "pdgate[otel]" in warnings[0]


def test_without_the_sdk_the_shim_warns_once_and_serves(tmp_path: Path) -> None:
    proc = _start(tmp_path, ["shim", "--model", "tiny", "--device", "cpu", "--no-kv-transfer",
                             "--num-blocks", "64"],
                  {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://127.0.0.1:4318/v1/traces"},
                  sdk=False)
    try:
        reply = httpx.post(proc.url + "/v1/completions", timeout=60, json={
            "model": "pdgate-tiny", "prompt": "Hello", "max_tokens": 2})
        assert reply.status_code == 200, reply.text
    finally:
        log = proc.stop()
    assert len([line for line in log.splitlines() if WARNING in line]) == 1, log


def test_grpc_export_with_the_endpoint_flag_and_the_service_name_from_the_environment(
    router: StartRouter,
) -> None:
    receiver = GrpcReceiver()
    try:
        # The chart's way (and vLLM's): the flag names the collector, the protocol variable
        # picks gRPC.
        proc = router({"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "grpc",
                       "OTEL_SERVICE_NAME": "edge-router"},
                      args=("--otlp-traces-endpoint", receiver.url))
        assert _ask(proc.url, TRACE_A).status_code == 503
        span = _server_span(receiver, TRACE_A)
        assert span.service == "edge-router"
        assert span.attributes["http.response.status_code"] == 503
    finally:
        receiver.close()


def test_grpc_export_from_a_shim(tmp_path: Path) -> None:
    receiver = GrpcReceiver()
    proc = _start(tmp_path, ["shim", "--model", "tiny", "--device", "cpu", "--no-kv-transfer",
                             "--num-blocks", "64"],
                  {"OTEL_EXPORTER_OTLP_PROTOCOL": "grpc",
                   "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.url})
    try:
        reply = httpx.post(proc.url + "/v1/completions", timeout=60, json={
            "model": "pdgate-tiny", "prompt": "Hello", "max_tokens": 2},
            headers={"traceparent": f"00-{TRACE_A}-{CLIENT_SPAN}-01"})
        assert reply.status_code == 200, reply.text
        span = _server_span(receiver, TRACE_A)
        assert span.service == "pdgate-shim"
    finally:
        proc.stop()
        receiver.close()


def test_http_export_to_the_environments_endpoint(router: StartRouter) -> None:
    receiver = HttpReceiver()
    try:
        # The general endpoint: the HTTP exporter appends /v1/traces itself.
        proc = router({"OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
                       "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.base})
        assert _ask(proc.url, TRACE_A).status_code == 503
        span = _server_span(receiver, TRACE_A)
        assert span.service == "pdgate-router"
    finally:
        receiver.close()


def test_the_sampler_from_the_environment(router: StartRouter) -> None:
    receiver = HttpReceiver()
    try:
        # Ratio 0 for new traces; a sampled parent is still followed.
        proc = router({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": receiver.url,
                       "OTEL_TRACES_SAMPLER": "parentbased_traceidratio",
                       "OTEL_TRACES_SAMPLER_ARG": "0"})
        for _ in range(5):
            assert _ask(proc.url, None).status_code == 503
        assert _ask(proc.url, TRACE_A).status_code == 503
        assert _ask(proc.url, TRACE_B).status_code == 503
        _server_span(receiver, TRACE_A)
        _server_span(receiver, TRACE_B)
        assert {s.trace_id for s in receiver.spans} == {TRACE_A, TRACE_B}
    finally:
        receiver.close()


@pytest.mark.parametrize(("env", "want"), [
    ({}, "http/protobuf"),
    ({"OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"}, "grpc"),
    ({"OTEL_EXPORTER_OTLP_PROTOCOL": "grpc",
      "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf"}, "http/protobuf"),
    ({"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": " GRPC "}, "grpc"),
])
def test_the_traces_protocol_variable_wins(env: dict[str, str], want: str) -> None:
    assert exporter_protocol(env) == want


@pytest.mark.parametrize(("env", "want"), [
    ({}, ("parentbased_always_on", 1.0)),
    ({"OTEL_TRACES_SAMPLER": "always_off"}, ("always_off", 1.0)),
    ({"OTEL_TRACES_SAMPLER": "traceidratio", "OTEL_TRACES_SAMPLER_ARG": "0.25"},
     ("traceidratio", 0.25)),
    ({"OTEL_TRACES_SAMPLER": "traceidratio", "OTEL_TRACES_SAMPLER_ARG": "2"},
     ("traceidratio", 1.0)),
    ({"OTEL_TRACES_SAMPLER": "traceidratio", "OTEL_TRACES_SAMPLER_ARG": "half"},
     ("traceidratio", 1.0)),
    ({"OTEL_TRACES_SAMPLER": "jaeger_remote"}, ("parentbased_always_on", 1.0)),
])
def test_sampler_settings_as_the_specification_reads_them(
    env: dict[str, str], want: tuple[str, float],
) -> None:
    assert sampler_setting(env) == want


def test_a_protocol_this_sdk_does_not_speak_is_a_warning(caplog: pytest.LogCaptureFixture
                                                         ) -> None:
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4318",
           "OTEL_EXPORTER_OTLP_PROTOCOL": "http/json"}
    with caplog.at_level(logging.WARNING, logger="pdgate.tracing"):
        assert open_tracing("pdgate-router", None, env) is None
    assert [r.getMessage() for r in caplog.records] == [
        "OTLP protocol 'http/json' is not supported (use one of http/protobuf, grpc); "
        "serving without tracing"]
