"""LoRA adapters through the router (router/adapters.py) against fake vLLM engines with
vLLM's LoRA API (tests/router/fake_lora_engine.py): which engines hold an adapter is learned
from their /v1/models; an adapter request goes only to a P and a D that both hold it, in
every flow; `load_on_demand` loads a missing adapter once per engine however many
requests wait; a failed load or a missing holder is a clear 503 naming the adapter, never
base-model output; an adapter unloaded between probes is noticed. Real vLLM:
tests/vllm/test_vllm_lora.py."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest

from pdgate.router.config import ConfigError, ModelConfig, RouterConfig
from pdgate.router.config_checks import validate_config
from pdgate.router.input.tokenization import PromptTokenizer
from pdgate.router.policies import POLICIES
from tests.router.conftest import MODEL, RunningRouter, serve, sse_events, until
from tests.router.fake_lora_engine import FakeLoraEngine

StartRouter = Callable[..., Awaitable[RunningRouter]]
MakeLora = Callable[..., Awaitable[FakeLoraEngine]]
SQL = "sql-lora"
BODY = {"model": SQL, "prompt": "Hello world", "max_tokens": 3}
LORA = {"enable_lora": True}


@pytest.fixture
async def make_lora() -> AsyncIterator[MakeLora]:
    engines: list[FakeLoraEngine] = []

    async def make(engine_id: str, *held: str, **knobs: Any) -> FakeLoraEngine:
        engine = FakeLoraEngine(engine_id=engine_id, adapters={n: f"/a/{n}" for n in held},
                                **knobs)
        await engine.start()
        engines.append(engine)
        return engine

    yield make
    for engine in engines:
        await engine.stop()


def _text(resp_text: str, stream: bool) -> str:
    if not stream:
        return str(json.loads(resp_text)["choices"][0]["text"])
    return "".join(e["choices"][0]["text"] for e in sse_events(resp_text)
                   if isinstance(e, dict) and e.get("choices"))


def _error(resp: Any) -> dict[str, Any]:
    return dict(resp.json()["error"])


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("mode", ["pull", "notify", "push"])
async def test_adapter_request_goes_to_a_p_and_a_d_that_both_hold_it(
    make_lora: MakeLora, start_router: StartRouter, mode: str, stream: bool
) -> None:
    p0, p1 = await make_lora("P0"), await make_lora("P1", SQL)
    d0, d1 = await make_lora("D0", SQL), await make_lora("D1")
    router = await start_router([p0, p1], [d0, d1], pd_mode=mode, kv_ready_timeout_s=5.0,
                                early_first_token=False, prefill_policy="round-robin",
                                decode_policy="round-robin", **LORA)
    for _ in range(4):  # round-robin alone would visit every engine
        resp = await router.client.post("/v1/completions", json={**BODY, "stream": stream})
        assert resp.status_code == 200, resp.text
        assert _text(resp.text, stream) == f"<{SQL}>Hello world!"
        assert resp.headers["X-Pdgate-Prefill-Engine"] == p1.url
        assert resp.headers["X-Pdgate-Decode-Engine"] == d0.url
    assert not p0.requests and not d1.requests
    assert {m for m, _ in p1.served + d0.served} == {SQL}
    base = await router.client.post("/v1/completions", json={**BODY, "model": MODEL})
    assert base.status_code == 200 and _text(base.text, False) == f"<{MODEL}>Hello world!"


async def test_colocated_and_pass_through_requests_go_to_a_holder(
    make_lora: MakeLora, start_router: StartRouter
) -> None:
    p = await make_lora("P0", SQL)
    d0, d1 = await make_lora("D0"), await make_lora("D1", SQL)
    # Every prompt is "short": the decider keeps it on a decode engine alone.
    router = await start_router([p], [d0, d1], disagg_min_tokens=10_000,
                                decode_policy="round-robin", **LORA)
    for _ in range(3):
        resp = await router.client.post("/v1/completions", json=BODY)
        assert resp.status_code == 200, resp.text
        assert _text(resp.text, False) == f"<{SQL}>Hello world!"
        assert resp.headers["X-Pdgate-Decode-Engine"] == d1.url
        emb = await router.client.post("/v1/embeddings", json={"model": SQL, "input": "x"})
        assert emb.status_code == 200 and emb.json()["model"] == SQL
        assert emb.headers["X-Pdgate-Decode-Engine"] == d1.url
    assert not p.requests and not d0.requests


async def test_models_lists_the_adapters_the_engines_hold(
    make_lora: MakeLora, start_router: StartRouter
) -> None:
    p, d = await make_lora("P0", SQL, "chat-lora"), await make_lora("D0", SQL)
    router = await start_router([p], [d], **LORA)
    cards = {c["id"]: c for c in (await router.client.get("/v1/models")).json()["data"]}
    assert set(cards) == {MODEL, SQL, "chat-lora"}
    assert cards[SQL]["parent"] == MODEL and cards[SQL]["root"] == f"/a/{SQL}"
    assert cards[MODEL]["parent"] is None
    one = await router.client.get(f"/v1/models/{SQL}")
    assert one.status_code == 200 and one.json()["parent"] == MODEL


async def test_models_reports_the_context_length_the_engines_serve(
    make_lora: MakeLora, start_router: StartRouter
) -> None:
    """LoRA off: the engines' cards are read once each. The tiny model's files allow more
    than the engines were started with; a request must fit whichever engine it lands on."""
    p, d = await make_lora("P0"), await make_lora("D0")
    p.max_model_len, d.max_model_len = 4096, 1536
    router = await start_router([p], [d])
    card = (await router.client.get("/v1/models")).json()["data"][0]
    assert (card["id"], card["max_model_len"], card["root"]) == (MODEL, 1536, "/m/base")
    # A configured context length is the operator's word.
    other = await start_router([p], [d], max_model_len=1000)
    assert (await other.client.get(f"/v1/models/{MODEL}")).json()["max_model_len"] == 1000


async def test_unknown_adapter_is_404_and_one_without_a_pair_is_503(
    make_lora: MakeLora, start_router: StartRouter
) -> None:
    p, d = await make_lora("P0", SQL, "p-only"), await make_lora("D0", SQL, "d-only")
    router = await start_router([p], [d], **LORA)
    missing = await router.client.post("/v1/completions", json={**BODY, "model": "nope"})
    assert missing.status_code == 404 and _error(missing)["code"] == "model_not_found"
    for name, role in (("p-only", "decode"), ("d-only", "prefill")):
        resp = await router.client.post("/v1/completions", json={**BODY, "model": name})
        assert resp.status_code == 503, resp.text
        err = _error(resp)
        assert err["code"] == "adapter_unavailable" and err["param"] == "model"
        assert f"no healthy {role} engine holds LoRA adapter `{name}`" in err["message"]
    # No engine served anything for them (and the base model never answered one).
    assert all(m == SQL for m, _ in p.served + d.served)
    assert not p.loads and not d.loads


@pytest.mark.parametrize("stream", [False, True])
async def test_load_on_demand_loads_once_per_engine_for_50_waiting_requests(
    make_lora: MakeLora, start_router: StartRouter, stream: bool
) -> None:
    p, d = await make_lora("P0", load_delay_s=0.5), await make_lora("D0", load_delay_s=0.5)
    router = await start_router([p], [d], load_on_demand=True,
                                lora_adapters=[f"{SQL}=/adapters/sql"], **LORA)
    resps = await asyncio.gather(*(router.client.post(
        "/v1/completions", json={**BODY, "stream": stream}) for _ in range(50)))
    for resp in resps:
        assert resp.status_code == 200, resp.text
        assert _text(resp.text, stream) == f"<{SQL}>Hello world!"
    assert p.loads == [{"lora_name": SQL, "lora_path": "/adapters/sql"}]
    assert d.loads == [{"lora_name": SQL, "lora_path": "/adapters/sql"}]
    assert router.metric("pdgate_lora_loads_total", {"result": "ok"}) == 2
    assert {m for m, _ in p.served + d.served} == {SQL}
    # Held now: no further load.
    again = await router.client.post("/v1/completions", json=BODY)
    assert again.status_code == 200 and len(p.loads) == len(d.loads) == 1


async def test_load_on_demand_takes_the_source_from_an_engine_that_holds_it(
    make_lora: MakeLora, start_router: StartRouter
) -> None:
    p, d = await make_lora("P0", SQL), await make_lora("D0")
    router = await start_router([p], [d], load_on_demand=True, **LORA)
    resp = await router.client.post("/v1/completions", json=BODY)
    assert resp.status_code == 200 and _text(resp.text, False) == f"<{SQL}>Hello world!"
    assert not p.loads and d.loads == [{"lora_name": SQL, "lora_path": f"/a/{SQL}"}]


@pytest.mark.parametrize("status", [404, 500])
async def test_failed_load_is_503_naming_the_adapter_never_base_output(
    make_lora: MakeLora, start_router: StartRouter, status: int
) -> None:
    p = await make_lora("P0", SQL)
    d = await make_lora("D0", load_fail_status=status, load_delay_s=0.2)
    router = await start_router([p], [d], load_on_demand=True, **LORA)
    resps = await asyncio.gather(*(router.client.post("/v1/completions", json=BODY)
                                   for _ in range(5)))
    for resp in resps:
        assert resp.status_code == 503, resp.text
        err = _error(resp)
        assert err["code"] == "adapter_load_failed"
        assert f"loading LoRA adapter `{SQL}` onto engine {d.url} failed" in err["message"]
    assert len(d.loads) == 1  # the five waited on one load
    await until(lambda: len(p.aborts) == 5)  # the prefills' blocks on P were released
    assert not d.served and router.metric("pdgate_lora_loads_total", {"result": "failed"}) == 1
    # A failure is not remembered: the next request tries again, and succeeds once it can.
    d.load_fail_status = None
    ok = await router.client.post("/v1/completions", json=BODY)
    assert ok.status_code == 200 and _text(ok.text, False) == f"<{SQL}>Hello world!"
    assert len(d.loads) == 2


async def test_adapter_unloaded_between_probes_is_never_served_by_the_base_model(
    make_lora: MakeLora, start_router: StartRouter
) -> None:
    p = await make_lora("P0", SQL)
    d0, d1 = await make_lora("D0", SQL), await make_lora("D1", SQL)
    router = await start_router([p], [d0, d1], decode_policy="round-robin", **LORA)
    del d0.adapters[SQL]  # unloaded on D0; the router's last probe still lists it
    for _ in range(3):
        resp = await router.client.post("/v1/completions", json=BODY)
        assert resp.status_code == 200, resp.text
        assert _text(resp.text, False) == f"<{SQL}>Hello world!"
        assert resp.headers["X-Pdgate-Decode-Engine"] == d1.url
    # D0 refused one leg (404) and was dropped as a holder, without blame on its health.
    assert len([r for r in d0.requests if not r.is_prefill]) <= 1 and not d0.served
    assert router.metric("pdgate_breaker_opened_total", {"role": "decode"}) == 0
    del d1.adapters[SQL]  # now no decode engine holds it
    resp = await router.client.post("/v1/completions", json=BODY)
    assert resp.status_code == 503 and _error(resp)["code"] == "adapter_unavailable"
    assert not d1.served[3:]


async def test_adapter_unloaded_between_probes_is_reloaded_on_demand(
    make_lora: MakeLora, start_router: StartRouter
) -> None:
    p, d = await make_lora("P0", SQL), await make_lora("D0", SQL)
    router = await start_router([p], [d], load_on_demand=True, **LORA)
    del d.adapters[SQL]
    resp = await router.client.post("/v1/completions", json={**BODY, "stream": True})
    assert resp.status_code == 200, resp.text
    assert _text(resp.text, True) == f"<{SQL}>Hello world!"
    assert d.loads == [{"lora_name": SQL, "lora_path": f"/a/{SQL}"}]


async def test_probes_keep_the_adapter_map_fresh(
    make_lora: MakeLora, start_router: StartRouter
) -> None:
    p, d = await make_lora("P0", SQL), await make_lora("D0", SQL)
    router = await start_router([p], [d], health_interval_s=0.05, **LORA)
    assert (await router.client.post("/v1/completions", json=BODY)).status_code == 200
    del d.adapters[SQL]

    async def status() -> int:
        return (await router.client.post("/v1/completions", json=BODY)).status_code

    await asyncio.sleep(0.3)  # a few probe rounds
    assert await status() == 503
    decodes = len(d.requests)
    assert await status() == 503 and len(d.requests) == decodes  # not even tried
    d.adapters["new-lora"] = "/a/new"
    await asyncio.sleep(0.3)
    new = await router.client.post("/v1/completions", json={**BODY, "model": "new-lora"})
    assert new.status_code == 503  # P does not hold it
    p.adapters["new-lora"] = "/a/new"
    await asyncio.sleep(0.3)
    new = await router.client.post("/v1/completions", json={**BODY, "model": "new-lora"})
    assert new.status_code == 200 and _text(new.text, False) == "<new-lora>Hello world!"


async def test_lora_off_keeps_adapter_names_unknown(
    make_lora: MakeLora, start_router: StartRouter
) -> None:
    p, d = await make_lora("P0", SQL), await make_lora("D0", SQL)
    router = await start_router([p], [d], health_interval_s=0.02)
    resp = await router.client.post("/v1/completions", json=BODY)
    assert resp.status_code == 404 and _error(resp)["code"] == "model_not_found"
    # Its model list was read once (the context length it serves with), not with every
    # probe as with LoRA on.
    probes = len([r for r in p.auth_seen if r[0] == "/health"])
    await until(lambda: len([r for r in p.auth_seen if r[0] == "/health"]) >= probes + 3)
    assert len([r for r in p.auth_seen if r[0] == "/v1/models"]) == 1


async def test_each_models_adapters_stay_on_its_engines(
    make_lora: MakeLora, tokenizer: PromptTokenizer
) -> None:
    """Two models: `alpha` on P/D whose engines hold `sql-lora`, `beta` colocated with
    load_on_demand and a configured source for `beta-lora`. Each adapter resolves to its
    own model and reaches only that model's engines."""
    pa, da = await make_lora("PA", SQL, base="alpha"), await make_lora("DA", SQL, base="alpha")
    db = await make_lora("DB", base="beta")
    config = RouterConfig(enable_lora=True, health_interval_s=3600.0, models=[
        ModelConfig(model="alpha", prefill=[pa.url], decode=[da.url]),
        ModelConfig(model="beta", decode=[db.url], pd_mode="colocated", load_on_demand=True,
                    lora_adapters=["beta-lora=/b/lora"]),
    ])
    async with serve(config, tokenizer) as router:
        sql = await router.client.post("/v1/completions", json=BODY)
        assert sql.status_code == 200 and _text(sql.text, False) == f"<{SQL}>Hello world!"
        assert sql.headers["X-Pdgate-Decode-Engine"] == da.url
        beta = await router.client.post("/v1/completions", json={**BODY, "model": "beta-lora"})
        assert beta.status_code == 200, beta.text
        assert _text(beta.text, False) == "<beta-lora>Hello world!"
        assert beta.headers["X-Pdgate-Decode-Engine"] == db.url
        assert db.loads == [{"lora_name": "beta-lora", "lora_path": "/b/lora"}]
        assert router.metric("pdgate_lora_loads_total", {"model": "beta", "result": "ok"}) == 1
        assert not pa.loads and not da.loads
        assert db.served == [("beta-lora", False)]
        assert {m for m, _ in pa.served + da.served} == {SQL}
        cards = {c["id"]: c for c in (await router.client.get("/v1/models")).json()["data"]}
        assert cards[SQL]["parent"] == "alpha" and cards["beta-lora"]["parent"] == "beta"
        # alpha may not load: an adapter only beta has a source for stays beta's.
        del da.adapters[SQL]
        gone = await router.client.post("/v1/completions", json=BODY)
        assert gone.status_code == 503 and _error(gone)["code"] == "adapter_unavailable"


@pytest.mark.parametrize(("fields", "message"), [
    ({"lora_adapters": ["no-path"]}, "lora_adapters: 'no-path' is not NAME=PATH"),
    ({"lora_adapters": ["=/p"]}, "lora_adapters: '=/p' is not NAME=PATH"),
    ({"enable_lora": True, "lora_load_timeout_s": 0}, "lora_load_timeout_s: must be > 0"),
])
def test_bad_lora_settings_are_named(fields: dict[str, Any], message: str) -> None:
    config = RouterConfig(model="m", prefill=["http://p:1"], decode=["http://d:1"], **fields)
    with pytest.raises(ConfigError, match=message):
        validate_config(config, frozenset(POLICIES))


def test_load_on_demand_or_sources_turn_lora_on() -> None:
    assert not RouterConfig(model="m").lora_on
    assert RouterConfig(model="m", load_on_demand=True).lora_on
    assert RouterConfig(model="m", lora_adapters=["a=/a"]).lora_on
    assert RouterConfig(models=[ModelConfig(model="a"), ModelConfig(
        model="b", load_on_demand=True)]).lora_on


async def test_adapter_gone_with_no_retry_left_is_503_naming_it(
    make_lora: MakeLora, start_router: StartRouter
) -> None:
    p, d = await make_lora("P0", SQL), await make_lora("D0", SQL)
    router = await start_router([p], [d], max_retries=0, **LORA)
    del d.adapters[SQL]
    resp = await router.client.post("/v1/completions", json=BODY)
    assert resp.status_code == 503, resp.text
    err = _error(resp)
    assert err["code"] == "adapter_unavailable"
    assert f"engine {d.url} no longer holds LoRA adapter `{SQL}`" in err["message"]
    assert not d.served
    await until(lambda: len(p.aborts) == 1)  # P's prefilled blocks were released
