"""Two models behind one router in front of REAL vLLM engines (the session's P, D and REF):
`alpha` on P/D (pull, NixlConnector), `beta` colocated on REF. Both are the tiny model
under the engines' one served name (`engine_model_name`): what is checked is the router's
side, routing by the request's `model` to that model's own engines and mode, not a second
set of weights (a third and fourth vLLM process would not fit this machine's two cores).

- `/v1/models` lists both, with vLLM's `max_model_len` and `root`;
- `alpha` requests go P then D (D's `external_kv_transfer` prompt tokens grow by the
  prompt), `beta` requests to REF alone (D sees none of them), and both answer what a
  colocated engine answers;
- the router's series carry the model; an unknown model is 404 `model_not_found`.
"""

from __future__ import annotations

import json

import httpx
import pytest

from tests.e2e.cluster import metric
from tests.vllm.conftest import VllmCluster
from tests.vllm.processes import SERVED_NAME, start_router_with_config, wait_ready
from tests.vllm.test_vllm_pd import complete, kv_sources

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

PROMPT = "Two models share one gateway, each with its own engines and its own mode: "


@pytest.fixture(scope="module")
def router(vllm_cluster: VllmCluster) -> str:
    c = vllm_cluster
    config = c.log_dir / "router-models" / "router.yaml"
    config.parent.mkdir(parents=True, exist_ok=True)
    models = [
        {"model": str(c.model_dir), "served_model_name": ["alpha"],
         "engine_model_name": SERVED_NAME, "prefill": [c.p.url], "decode": [c.d.url],
         "pd_mode": "pull"},
        {"model": str(c.model_dir), "served_model_name": ["beta"],
         "engine_model_name": SERVED_NAME, "decode": [c.ref.url], "pd_mode": "colocated"},
    ]
    config.write_text(json.dumps({"models": models}))  # JSON is YAML
    proc = start_router_with_config(config, config.parent)
    c.stack.callback(proc.stop)
    wait_ready([proc], "/ready", 60.0)
    return proc.url


def ask(router: str, model: str, prompt: str) -> httpx.Response:
    resp = httpx.post(router + "/v1/completions", timeout=300, json={
        "model": model, "prompt": prompt, "max_tokens": 8, "temperature": 0,
        "ignore_eos": True})
    assert resp.status_code == 200, resp.text
    return resp


def test_models_are_listed_with_what_vllm_reports(router: str) -> None:
    listed = {m["id"]: m for m in httpx.get(router + "/v1/models", timeout=30).json()["data"]}
    assert set(listed) == {"alpha", "beta"}
    for m in listed.values():
        assert m["max_model_len"] == 1024  # the engines' --max-model-len (tests/vllm)
    for name in ("alpha", "beta"):
        assert httpx.get(router + f"/ready?model={name}", timeout=30).status_code == 200


def test_each_model_is_served_by_its_engines_in_its_mode(
    vllm_cluster: VllmCluster, router: str,
) -> None:
    c = vllm_cluster
    want = complete(c.ref.url, PROMPT + "alpha", 8).choices[0].text
    d_before = kv_sources(c.d.url)
    a = ask(router, "alpha", PROMPT + "alpha")
    assert a.json()["choices"][0]["text"] == want
    assert a.json()["model"] == SERVED_NAME  # the engines' name, as vLLM answers an alias
    assert a.headers["x-pdgate-prefill-engine"] == c.p.url
    assert a.headers["x-pdgate-decode-engine"] == c.d.url
    d_after = kv_sources(c.d.url)
    assert d_after[0] > d_before[0] and d_after[1] == d_before[1]  # the prompt over NIXL

    want = complete(c.ref.url, PROMPT + "beta", 8).choices[0].text
    b = ask(router, "beta", PROMPT + "beta")
    assert b.json()["choices"][0]["text"] == want
    assert b.json()["model"] == SERVED_NAME
    assert "x-pdgate-prefill-engine" not in b.headers
    assert b.headers["x-pdgate-decode-engine"] == c.ref.url
    assert kv_sources(c.d.url) == d_after  # beta never reached D

    decisions = "pdgate_disagg_decisions_total"
    assert metric(router, decisions, 'reason="colocated"') == \
        metric(router, decisions, 'model="beta"') >= 1
    assert metric(router, decisions, 'model="alpha"') >= 1
    unknown = httpx.post(router + "/v1/completions", timeout=30,
                         json={"model": "gamma", "prompt": "x"})
    assert unknown.status_code == 404
    assert unknown.json()["error"]["code"] == "model_not_found"
