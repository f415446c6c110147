"""Secure by default: a shim on a non-loopback address needs an engine key, or an explicit
`--allow-unauthenticated` that it announces at start and in `GET /health`.

Real `python -m pdgate.engine_shim` processes. The non-loopback bind is 0.0.0.0 (the
chart's); the tests still reach it only through 127.0.0.1."""

from __future__ import annotations

import subprocess
from pathlib import Path

import httpx
import pytest

from pdgate.engine_shim.cli import is_loopback
from tests.engine_shim.process import ROOT, free_port, shim_argv, shim_process

KEY = "engine-key-0123456789"


def test_a_non_loopback_shim_without_a_key_refuses_to_start(tiny_model_dir: Path) -> None:
    done = subprocess.run(
        shim_argv(tiny_model_dir, free_port(), "--host", "0.0.0.0", "--no-kv-transfer"),
        cwd=ROOT, env={"PATH": "/usr/bin:/bin"}, capture_output=True, timeout=120)
    assert done.returncode != 0
    err = done.stderr.decode()
    assert "refusing to serve on 0.0.0.0 without an API key" in err, err
    assert "--allow-unauthenticated" in err and "PDGATE_ENGINE_API_KEY" in err


def test_allow_unauthenticated_starts_open_and_says_so(tiny_model_dir: Path,
                                                       tmp_path: Path) -> None:
    log = tmp_path / "stderr"
    with shim_process(tiny_model_dir, "--no-kv-transfer", "--allow-unauthenticated",
                      host="0.0.0.0", stderr=log) as shim:
        assert "serving UNAUTHENTICATED on 0.0.0.0" in log.read_text()
        health = httpx.get(shim.url + "/health", timeout=10)
        assert health.json() == {"status": "ok", "auth": "unauthenticated"}
        r = httpx.get(shim.url + "/v1/models", timeout=10)
        assert r.status_code == 200


def test_a_non_loopback_shim_with_a_key_starts_and_guards(tiny_model_dir: Path) -> None:
    with shim_process(tiny_model_dir, "--no-kv-transfer", host="0.0.0.0",
                      env={"PDGATE_ENGINE_API_KEY": KEY}) as shim:
        assert httpx.get(shim.url + "/health", timeout=10).json() == {
            "status": "ok", "auth": "api-key"}
        assert httpx.get(shim.url + "/v1/models", timeout=10).status_code == 401


@pytest.mark.parametrize(("host", "loopback"), [
    ("127.0.0.1", True), ("127.0.0.2", True), ("localhost", True), ("::1", True),
    ("[::1]", True), ("0.0.0.0", False), ("::", False), ("10.0.0.5", False),
    ("engine.example", False),
])
def test_which_binds_count_as_loopback(host: str, loopback: bool) -> None:
    assert is_loopback(host) is loopback
