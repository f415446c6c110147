"""The admin API: list, add, drain and remove engines at run time; the effective config."""

from __future__ import annotations

from pathlib import Path

import pytest

from pdgate.router.config import ClientKey, ConfigError, RouterConfig
from pdgate.router.config_checks import validate_config
from pdgate.router.errors import InvalidRequest
from pdgate.router.http.admin import check_engine_url
from pdgate.router.policies import POLICIES
from tests.router.conftest import MODEL
from tests.router.test_errors import COMPLETIONS, MakeEngine, StartRouter

ADMIN = {"Authorization": "Bearer admin-secret-1"}
BODY = {"model": MODEL, "prompt": "x"}


@pytest.mark.parametrize("url", [
    "ftp://10.0.0.1:8000", "http://", "http://:8000", "10.0.0.1:8000", "http://u:p@h:1",
    "http://h:1/v1", "http://h:1?x=1", "http://h:1#f", "http://h:99999", "javascript:alert(1)",
    "http://a b", "http://a b:8000", "http://a\tb:1", "http://-bad-:1", "http://a..b:1",
])
def test_bad_engine_urls_are_refused(url: str) -> None:
    with pytest.raises(InvalidRequest):
        check_engine_url(url)


def test_good_engine_urls_are_normalized() -> None:
    assert check_engine_url("http://10.0.0.1:8000/") == "http://10.0.0.1:8000"
    assert check_engine_url("https://engine.svc") == "https://engine.svc"
    assert check_engine_url("http://[::1]:8100") == "http://[::1]:8100"


async def test_admin_api_is_off_without_its_key(
    make_engine: MakeEngine, start_router: StartRouter
) -> None:
    router = await start_router([await make_engine()], [await make_engine()])
    assert (await router.client.get("/admin/engines")).status_code == 404


async def test_list_add_drain_remove(make_engine: MakeEngine, start_router: StartRouter) -> None:
    p, d0, d1 = await make_engine(), await make_engine(), await make_engine()
    router = await start_router([p], [d0], admin_api_key="admin-secret-1",
                                decode_policy="round-robin")
    c = router.client
    engines = (await c.get("/admin/engines", headers=ADMIN)).json()["engines"]
    assert [(e["url"], e["role"], e["healthy"], e["breaker"]) for e in engines] == [
        (p.url, "prefill", True, "closed"), (d0.url, "decode", True, "closed")]
    assert engines[0]["in_flight"] == 0

    added = await c.post("/admin/engines", headers=ADMIN, json={"url": d1.url, "role": "decode"})
    assert added.status_code == 201 and added.json()["url"] == d1.url
    again = await c.post("/admin/engines", headers=ADMIN, json={"url": d1.url, "role": "decode"})
    assert again.status_code == 200  # idempotent
    for _ in range(4):
        assert (await c.post(COMPLETIONS, json=BODY)).status_code == 200
    assert len(d0.decodes) == 2 and len(d1.decodes) == 2

    drained = await c.delete("/admin/engines", headers=ADMIN,
                             params={"url": d0.url, "drain": "true"})
    assert drained.status_code == 200 and drained.json()["removed"] is True  # it was idle
    for _ in range(2):
        assert (await c.post(COMPLETIONS, json=BODY)).status_code == 200
    assert len(d0.decodes) == 2 and len(d1.decodes) == 4

    removed = await c.delete("/admin/engines", headers=ADMIN,
                             params={"url": p.url, "drain": "false"})
    assert removed.status_code == 200
    urls = [e["url"] for e in (await c.get("/admin/engines", headers=ADMIN)).json()["engines"]]
    assert urls == [d1.url]
    missing = await c.delete("/admin/engines", headers=ADMIN, params={"url": p.url})
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "engine_not_found"


@pytest.mark.parametrize("body", [
    {"url": "ftp://x:1", "role": "decode"}, {"url": "http://x:1", "role": "both"},
    {"url": "http://a b", "role": "decode"},
    {"url": "http://x:1"}, {"url": "http://x:1", "role": "decode", "extra": 1}, "not json",
])
async def test_add_engine_rejects_bad_bodies(
    make_engine: MakeEngine, start_router: StartRouter, body: object
) -> None:
    router = await start_router([await make_engine()], [await make_engine()],
                                admin_api_key="admin-secret-1")
    kw = {"content": body} if isinstance(body, str) else {"json": body}
    resp = await router.client.post("/admin/engines", headers=ADMIN, **kw)  # type: ignore[arg-type]
    assert resp.status_code == 400 and "error" in resp.json()
    assert len((await router.client.get("/admin/engines", headers=ADMIN)).json()["engines"]) == 2


async def test_admin_config_is_the_effective_config(
    make_engine: MakeEngine, start_router: StartRouter
) -> None:
    keys = [ClientKey(key="team-secret-1", name="team", priority=2)]
    router = await start_router([await make_engine()], [await make_engine()],
                                admin_api_key="admin-secret-1", max_retries=3,
                                client_keys=keys)
    resp = await router.client.get("/admin/config", headers=ADMIN)
    config = resp.json()
    assert config["max_retries"] == 3 and config["api_key"] is None
    assert config["admin_api_key"] == "<redacted>"
    assert config["client_keys"] == [{"key": "<redacted>", "name": "team", "priority": 2,
                                      "tokens_per_minute": None}]
    assert "team-secret-1" not in resp.text


def test_static_engine_urls_get_the_same_checks(tiny_model_dir: Path) -> None:
    for url in ("http://user:pw@10.0.0.1:8000", "http://10.0.0.1:8000/v1", "http://:80"):
        config = RouterConfig(model=str(tiny_model_dir), prefill=[url], decode=["http://d:1"])
        with pytest.raises(ConfigError, match="prefill"):
            validate_config(config, frozenset(POLICIES))
