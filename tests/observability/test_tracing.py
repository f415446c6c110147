"""OpenTelemetry through a real `pdgate up` (router and shim engines as processes): spans go
over OTLP/HTTP to a receiver this test owns on loopback, and form one trace from the
client's `traceparent` through the router to both engine legs."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.e2e.cluster import Cluster, start_cluster
from tests.observability.otlp import HttpReceiver as Receiver
from tests.observability.otlp import Span

pytestmark = pytest.mark.slow

CLIENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"


@pytest.fixture(scope="module")
def traced(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
           ) -> Iterator[tuple[Cluster, Receiver]]:
    receiver = Receiver()
    # Children inherit the environment: export every 100 ms instead of every 5 s.
    saved = os.environ.get("OTEL_BSP_SCHEDULE_DELAY")
    os.environ["OTEL_BSP_SCHEDULE_DELAY"] = "100"
    try:
        c = start_cluster(tmp_path_factory.mktemp("otel"), tiny_model_dir,
                          extra=["--otlp-traces-endpoint", receiver.url])
    finally:
        if saved is None:
            del os.environ["OTEL_BSP_SCHEDULE_DELAY"]
        else:
            os.environ["OTEL_BSP_SCHEDULE_DELAY"] = saved
    try:
        yield c, receiver
    finally:
        c.stop()
        receiver.close()


def spans_of(receiver: Receiver, trace_id: str, legs: int, route: str = "POST /v1/completions"
             ) -> list[Span]:
    """The trace once the router's span for `route` and `legs` engine request spans are in.
    A span ends after its children and an exporter sends spans in the order they end, so a
    process's request span arriving means its children have too."""
    def done(spans: list[Span]) -> bool:
        router = [s for s in spans if s.service == "pdgate-router" and s.name == route]
        shim = [s for s in spans if s.service == "pdgate-shim" and s.name.startswith("POST")]
        return bool(router) and len(shim) >= legs
    return receiver.of_trace(trace_id, done)


def test_one_trace_from_the_client_through_the_router_to_both_legs(
    traced: tuple[Cluster, Receiver],
) -> None:
    cluster, receiver = traced
    reply = httpx.post(cluster.router + "/v1/completions", timeout=120, json={
        "model": "tiny", "prompt": "Hello tracing", "max_tokens": 4, "ignore_eos": True,
    }, headers={"traceparent": f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"})
    assert reply.status_code == 200, reply.text
    # The router's 6 spans, and per engine leg its request span with tokenize, queue,
    # await_reader, prefill and decode inside (plus kv_transfer on D).
    spans = spans_of(receiver, CLIENT_TRACE, legs=2)
    routers = [s for s in spans if s.service == "pdgate-router" and s.parent_id == CLIENT_SPAN]
    assert [s.name for s in routers] == ["POST /v1/completions"], spans
    router = routers[0]
    inner = sorted(s.name for s in spans if s.service == "pdgate-router" and s is not router)
    # Pull + round-robin needs no tokens, so no tokenize span.
    assert inner == ["admission_wait", "choose_engine", "choose_engine", "decode_leg",
                     "prefill_leg"], spans
    chosen = {s.attributes["pdgate.role"]: s.attributes["pdgate.engine"] for s in spans
              if s.name == "choose_engine"}
    assert chosen == {"prefill": cluster.prefill[0], "decode": cluster.decode[0]}
    by_name = {s.name: s for s in spans if s.service == "pdgate-router"}
    for name in ("admission_wait", "prefill_leg", "decode_leg"):
        assert by_name[name].parent_id == router.span_id
    # Each leg's engine choice happens inside that leg.
    legs_of = {by_name["prefill_leg"].span_id: "prefill", by_name["decode_leg"].span_id: "decode"}
    assert {legs_of[s.parent_id]: s.attributes["pdgate.role"] for s in spans
            if s.name == "choose_engine"} == {"prefill": "prefill", "decode": "decode"}
    assert router.parent_id == CLIENT_SPAN  # continues the client's trace
    assert router.attributes["http.response.status_code"] == 200
    assert router.attributes["pdgate.request_id"] == reply.headers["x-pdgate-request-id"]
    assert router.attributes["pdgate.prefill_engine"] == cluster.prefill[0]
    assert router.attributes["pdgate.decode_engine"] == cluster.decode[0]
    legs = [s for s in spans if s.service == "pdgate-shim" and s.name.startswith("POST")]
    # One span per engine leg, each a child of the router's span, carrying the id engines
    # logged the request under.
    assert sorted(s.name for s in legs) == ["POST /v1/completions"] * 2, spans
    assert all(s.parent_id == router.span_id for s in legs)
    assert {s.attributes["pdgate.request_id"] for s in legs} == {
        reply.headers["x-pdgate-request-id"]}


STREAM_TRACE = "5af92f3577b34da6a3ce929d0e0e4737"


def test_a_streamed_request_shows_its_decode_stream_and_first_token(
    traced: tuple[Cluster, Receiver],
) -> None:
    cluster, receiver = traced
    with httpx.stream("POST", cluster.router + "/v1/completions", timeout=120, json={
        "model": "tiny", "prompt": "Hello streamed tracing", "max_tokens": 4,
        "ignore_eos": True, "stream": True,
    }, headers={"traceparent": f"00-{STREAM_TRACE}-{CLIENT_SPAN}-01"}) as reply:
        assert reply.status_code == 200
        body = b"".join(reply.iter_bytes())
    assert body.endswith(b"data: [DONE]\n\n")
    events = [json.loads(line[6:]) for line in body.split(b"\n")
              if line.startswith(b"data: {")]
    # Not asked for: the router counted the final usage chunk, the client never sees it.
    assert events and all(e["choices"] and e.get("usage") is None for e in events)
    spans = spans_of(receiver, STREAM_TRACE, legs=2)
    (router,) = [s for s in spans if s.service == "pdgate-router" and s.parent_id == CLIENT_SPAN]
    inner = {s.name: s for s in spans if s.service == "pdgate-router" and s is not router}
    assert {"prefill_leg", "decode_leg_open", "decode_stream", "first_token"} <= set(inner)
    first, stream = inner["first_token"], inner["decode_stream"]
    assert first.start_ns <= inner["prefill_leg"].start_ns  # it starts at the arrival
    assert stream.start_ns < first.end_ns <= stream.end_ns  # the first byte went out in it
    assert first.attributes["pdgate.ttft_s"] > 0
    for name in ("prefill_leg", "decode_leg_open", "decode_stream", "first_token"):
        assert inner[name].parent_id == router.span_id, name


PASSTHROUGH_TRACE = "6cf92f3577b34da6a3ce929d0e0e4738"


def test_a_pass_through_route_is_traced(traced: tuple[Cluster, Receiver]) -> None:
    """A pass-through route (router/http/passthrough.py) gets the completion routes' server
    span: one per request, continuing the client's trace, with the status the client got
    (the shim serves no /tokenize: its 404 is relayed as it is)."""
    cluster, receiver = traced
    reply = httpx.post(cluster.router + "/tokenize", timeout=60,
                       json={"model": "tiny", "prompt": "Hello"},
                       headers={"traceparent": f"00-{PASSTHROUGH_TRACE}-{CLIENT_SPAN}-01"})
    spans = [s for s in spans_of(receiver, PASSTHROUGH_TRACE, legs=0, route="POST /tokenize")
             if s.service == "pdgate-router" and s.parent_id == CLIENT_SPAN]
    assert [s.name for s in spans] == ["POST /tokenize"], spans
    assert spans[0].attributes["http.response.status_code"] == reply.status_code
    assert spans[0].attributes["pdgate.request_id"] == reply.headers["x-pdgate-request-id"]


def test_probes_are_not_traced(traced: tuple[Cluster, Receiver]) -> None:
    cluster, receiver = traced
    for _ in range(3):
        assert httpx.get(cluster.router + "/ready", timeout=10).status_code == 200
        assert httpx.get(cluster.decode[0] + "/health", timeout=10).status_code == 200
    time.sleep(0.5)
    assert not [s for s in receiver.spans if "/health" in s.name or "/ready" in s.name]


def test_the_shim_spans_account_for_the_engines_time(
    traced: tuple[Cluster, Receiver],
) -> None:
    cluster, receiver = traced
    trace = "5bf92f3577b34da6a3ce929d0e0e4737"
    # A stop string keeps the plain pull flow (no early first token, whose decode leg sends
    # D token ids), so both engines tokenize the text prompt.
    reply = httpx.post(cluster.router + "/v1/completions", timeout=120, json={
        "model": "tiny", "prompt": "Hello spans, a prompt of a few blocks", "max_tokens": 4,
        "ignore_eos": True, "stream": True, "temperature": 0, "stop": ["<never said>"],
    }, headers={"traceparent": f"00-{trace}-{CLIENT_SPAN}-01"})
    assert reply.status_code == 200, reply.text
    spans = spans_of(receiver, trace, legs=2)
    shim = [s for s in spans if s.service == "pdgate-shim"]
    legs = {s.span_id: s for s in shim if s.name == "POST /v1/completions"}
    assert len(legs) == 2, spans
    inner: dict[str, dict[str, Span]] = {leg: {} for leg in legs}
    for s in shim:
        if s.parent_id in legs:
            inner[s.parent_id][s.name] = s
    by_role = {("D" if "kv_transfer" in names else "P"): names for names in inner.values()}
    assert sorted(by_role["P"]) == ["await_reader", "decode", "prefill", "queue",
                                    "tokenize"], spans
    assert sorted(by_role["D"]) == ["await_reader", "decode", "kv_transfer", "prefill",
                                    "queue", "tokenize"], spans
    # Between admission and the KV transfer D sends its SSE head (the router streams the
    # decode leg); P answers the router's prefill leg as JSON.
    assert by_role["D"]["await_reader"].attributes["pdgate.waited_for"] == "response_head"
    assert by_role["P"]["await_reader"].attributes["pdgate.waited_for"] == "collector_task"
    assert by_role["D"]["tokenize"].attributes["pdgate.prompt_chars"] > 0
    # The children follow each other with no gap left uncovered between them (a few ms of
    # scheduling on a loaded test machine at most; the queue -> kv_transfer gap was 10-30).
    for names in by_role.values():
        order = sorted(names.values(), key=lambda s: s.start_ns)
        assert [s.name for s in order][:3] == ["tokenize", "queue", "await_reader"], order
        for before, after in zip(order, order[1:], strict=False):
            gap_ms = (after.start_ns - before.end_ns) / 1e6
            assert gap_ms < 10, f"{gap_ms:.1f} ms uncovered before {after.name}: {order}"
    kv = by_role["D"]["kv_transfer"].attributes
    # Pull mode: D READs the prompt's blocks from P, whose NIXL side channel it names.
    assert (kv["pdgate.kv.mode"], kv["pdgate.kv.op"]) == ("pull", "READ")
    assert kv["pdgate.kv.bytes"] > 0 and kv["pdgate.kv.descriptors"] >= 1
    assert kv["pdgate.kv.peer"].startswith("127.0.0.1:")
    assert kv["pdgate.kv.reused_tokens"] > 0
    # P prefilled the prompt and decoded its one token; D reused P's KV and decoded 4.
    assert by_role["P"]["decode"].attributes["pdgate.output_tokens"] == 1
    assert by_role["D"]["decode"].attributes["pdgate.output_tokens"] == 4
    assert by_role["D"]["prefill"].attributes["pdgate.cached_tokens"] > 0
    assert by_role["P"]["queue"].attributes["pdgate.prompt_tokens"] == \
        by_role["P"]["prefill"].attributes["pdgate.prompt_tokens"]
