"""Engine authentication (engine_shim/auth.py, credentials.py, `--api-key`).

The attacks of an open engine are replayed against a live shim with a key: holding every KV
block with `POST /v1/kv/reserve`, freeing another request's blocks with `POST /v1/kv/abort`,
listing request ids on `GET /debug/kv_transfers`, completions past the router, reading
`/metrics` with `--protect-metrics`. Each is a 401 with an OpenAI error body and changes
nothing; the same calls with the key work. Keys come from the flag, the environment or a
mounted file (also through the real CLI process).
"""

from __future__ import annotations

import logging
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from pdgate.engine_shim import credentials
from pdgate.engine_shim.cli import (
    ConnectorSettings,
    build_parser,
    nixl_connector_factory,
    secured_settings,
)
from pdgate.engine_shim.server import ServerSettings
from tests.engine_shim.live import MODEL, NUM_BLOCKS, Shim, start_shim, stop_shim

KEY = "engine-key-0123456789"
GOOD = {"Authorization": f"Bearer {KEY}"}
UNAUTHORIZED = {"error": {
    "message": "Incorrect or missing API key. Send it as 'Authorization: Bearer <key>'.",
    "type": "AuthenticationError", "param": None, "code": 401}}
COMPLETION = {"model": MODEL, "prompt": "Hi", "max_tokens": 2, "ignore_eos": True}
# (method, path, JSON body) of every route but /health and /metrics, plus an unknown one.
GUARDED: list[tuple[str, str, dict[str, Any] | None]] = [
    ("POST", "/v1/kv/reserve", {"request_id": "grab", "num_tokens": 200}),
    ("POST", "/v1/kv/abort", {"request_id": "victim"}),
    ("GET", "/debug/kv_transfers", None),
    ("POST", "/v1/completions", COMPLETION),
    ("POST", "/v1/chat/completions", {"model": MODEL, "max_tokens": 2,
                                      "messages": [{"role": "user", "content": "Hi"}]}),
    ("GET", "/v1/models", None),
    ("GET", "/v1/kv/info", None),
    ("POST", "/v1/kv/info", None),
    ("GET", "/no/such/route", None),
    ("POST", "/health", None),  # only GET /health is open
    ("GET", "/health/", None),
]
WRONG: list[dict[str, str]] = [
    {}, {"Authorization": "Bearer wrong-key-0123456789"}, {"Authorization": f"Basic {KEY}"},
    {"Authorization": KEY}, {"Authorization": f"Bearer {KEY}x"},
    {"Authorization": f"Bearer {KEY[:-1]}"}, {"Authorization": "Bearer"},
]


def _keyed(model_dir: Path, **settings: Any) -> Shim:
    factory = nixl_connector_factory(ConnectorSettings(
        engine_id="auth-test", side_channel_host="127.0.0.1", side_channel_port=0,
        lease_seconds=60.0))
    return start_shim(model_dir, connector_factory=factory,
                      settings=ServerSettings(api_key=KEY, **settings))


@pytest.fixture(scope="module")
def keyed(tiny_model_dir: Path) -> Iterator[Shim]:
    s = _keyed(tiny_model_dir)
    yield s
    stop_shim(s)


def _call(shim: Shim, method: str, path: str, body: dict[str, Any] | None,
          headers: dict[str, str]) -> httpx.Response:
    return httpx.request(method, shim.url + path, json=body, headers=headers, timeout=60)


def _refused(shim: Shim) -> float:
    for line in httpx.get(shim.url + "/metrics", timeout=10).text.splitlines():
        if line.startswith('pdgate_shim_http_refused_total{reason="unauthorized"}'):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


@pytest.mark.parametrize(("method", "path", "body"), GUARDED, ids=[f"{m} {p}" for m, p, _ in
                                                                   GUARDED])
def test_every_guarded_route_refuses_missing_or_wrong_keys(
    keyed: Shim, method: str, path: str, body: dict[str, Any] | None,
) -> None:
    before = _refused(keyed)
    for headers in WRONG:
        r = _call(keyed, method, path, body, headers)
        assert r.status_code == 401, (headers, r.text)
        assert r.json() == UNAUTHORIZED
        assert r.headers["www-authenticate"] == "Bearer"
    assert _refused(keyed) == before + len(WRONG)
    # Nothing happened: no block reserved, leased or busy.
    assert keyed.metric("pdgate_shim_kv_blocks_free") == NUM_BLOCKS


def test_the_key_opens_every_route_and_reserve_abort_work(keyed: Shim) -> None:
    for method, path, body in GUARDED[2:8]:
        r = _call(keyed, method, path, body, GOOD)
        assert r.status_code == 200, (path, r.text)
    lower = {"authorization": f"bearer {KEY}"}  # the scheme is case-insensitive
    assert _call(keyed, "GET", "/v1/models", None, lower).status_code == 200
    r = _call(keyed, "POST", "/v1/kv/reserve", {"request_id": "mine", "num_tokens": 40}, GOOD)
    assert r.status_code == 200, r.text
    assert keyed.metric("pdgate_shim_kv_blocks_free") == NUM_BLOCKS - len(r.json()["block_ids"])
    r = _call(keyed, "POST", "/v1/kv/abort", {"request_id": "mine"}, GOOD)
    assert r.status_code == 200
    keyed.wait_pool_full()


def test_health_and_metrics_stay_open_without_a_key(keyed: Shim) -> None:
    assert httpx.get(keyed.url + "/health", timeout=10).status_code == 200
    r = httpx.get(keyed.url + "/metrics", timeout=10)
    assert r.status_code == 200 and "pdgate_shim_kv_blocks_free" in r.text


def test_protect_metrics_needs_the_key_for_metrics_only(tiny_model_dir: Path) -> None:
    shim = _keyed(tiny_model_dir, protect_metrics=True)
    try:
        assert httpx.get(shim.url + "/metrics", timeout=10).status_code == 401
        r = httpx.get(shim.url + "/metrics", headers=GOOD, timeout=10)
        assert r.status_code == 200 and "pdgate_shim_kv_blocks_free" in r.text
        assert httpx.get(shim.url + "/health", timeout=10).status_code == 200
    finally:
        stop_shim(shim)


def test_an_engine_without_a_key_stays_open_and_says_so(
    tiny_model_dir: Path, caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.WARNING, logger="pdgate.engine_shim.server"):
        shim = start_shim(tiny_model_dir)
    try:
        assert "every route of this engine" in caplog.text and "open" in caplog.text
        assert httpx.get(shim.url + "/v1/models", timeout=10).status_code == 200
    finally:
        stop_shim(shim)


# ---- where keys come from ----


def _settings(argv: list[str], environ: dict[str, str]) -> tuple[ServerSettings, str | None]:
    return secured_settings(build_parser().parse_args(argv), environ)


def test_keys_come_from_flag_then_env_then_file(tmp_path: Path) -> None:
    key_file, secret_file = tmp_path / "key", tmp_path / "secret"
    key_file.write_text(KEY + "\n")  # a Kubernetes secret mount may end in a newline
    secret_file.write_text("notify-secret-0123456789\n")
    edge, secret = _settings([], {})
    assert edge.api_key is None and secret is None and not edge.protect_metrics
    edge, secret = _settings([], {"PDGATE_ENGINE_API_KEY": KEY,
                                  "PDGATE_NOTIFY_SECRET": "from-env-secret"})
    assert edge.api_key == KEY and secret == "from-env-secret"
    edge, secret = _settings(["--protect-metrics"], {
        "PDGATE_ENGINE_API_KEY_FILE": str(key_file),
        "PDGATE_NOTIFY_SECRET_FILE": str(secret_file)})
    assert edge.api_key == KEY and secret == "notify-secret-0123456789"
    assert edge.protect_metrics
    edge, secret = _settings(["--api-key", "flag-key-123", "--notify-secret", "flag-secret"],
                             {"PDGATE_ENGINE_API_KEY": KEY, "PDGATE_NOTIFY_SECRET": "x"})
    assert edge.api_key == "flag-key-123" and secret == "flag-secret"
    # An empty variable counts as unset (a chart may render it unconditionally).
    assert _settings([], {"PDGATE_ENGINE_API_KEY": ""})[0].api_key is None


@pytest.mark.parametrize(("argv", "environ", "error"), [
    (["--api-key", "short"], {}, "at least 8 characters"),
    (["--api-key", ""], {}, "--api-key is empty"),
    ([], {"PDGATE_ENGINE_API_KEY": KEY, "PDGATE_ENGINE_API_KEY_FILE": "/x"}, "both set"),
    ([], {"PDGATE_ENGINE_API_KEY_FILE": "/no/such/file"}, "cannot read"),
    ([], {"PDGATE_NOTIFY_SECRET_FILE": "EMPTY"}, "is empty"),
    (["--protect-metrics"], {}, "--protect-metrics needs an API key"),
], ids=["short", "empty-flag", "var-and-file", "missing-file", "empty-file", "metrics-no-key"])
def test_unusable_keys_stop_startup(tmp_path: Path, argv: list[str], environ: dict[str, str],
                                    error: str) -> None:
    empty = tmp_path / "empty"
    empty.write_text("\n")
    env = {k: str(empty) if v == "EMPTY" else v for k, v in environ.items()}
    with pytest.raises(credentials.CredentialError, match=error):
        _settings(argv, env)


def test_cli_reads_the_key_from_a_mounted_file(tiny_model_dir: Path, tmp_path: Path) -> None:
    key_file = tmp_path / "api-key"
    key_file.write_text(KEY + "\n")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [sys.executable, "-m", "pdgate.engine_shim", "--model", str(tiny_model_dir),
         "--served-model-name", MODEL, "--port", str(port), "--no-kv-transfer",
         "--log-level", "warning"],
        cwd=Path(__file__).resolve().parents[2],
        env={"PATH": "/usr/bin:/bin", "PDGATE_ENGINE_API_KEY_FILE": str(key_file)},
    )
    try:
        url, deadline = f"http://127.0.0.1:{port}", time.monotonic() + 120
        while True:
            assert proc.poll() is None, "the shim exited during startup"
            assert time.monotonic() < deadline, "the shim did not become healthy"
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        assert httpx.post(url + "/v1/completions", json=COMPLETION,
                          timeout=30).status_code == 401
        r = httpx.post(url + "/v1/completions", json=COMPLETION, headers=GOOD, timeout=30)
        assert r.status_code == 200, r.text
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


async def test_websockets_need_the_key_too() -> None:
    from pdgate.engine_shim.auth import EngineAuth

    reached: list[str] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        reached.append(scope["path"])

    sent: list[dict[str, Any]] = []

    async def send(message: Any) -> None:
        sent.append(message)

    async def receive() -> Any:
        return {"type": "websocket.connect"}

    auth = EngineAuth(app, api_key=KEY)
    await auth({"type": "websocket", "path": "/health", "headers": []}, receive, send)
    assert sent == [{"type": "websocket.close", "code": 1008}] and reached == []
    headers = [(b"authorization", f"Bearer {KEY}".encode())]
    await auth({"type": "websocket", "path": "/health", "headers": headers}, receive, send)
    assert reached == ["/health"]
