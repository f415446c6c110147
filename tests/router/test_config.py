"""Config loading (YAML + flags), strict decoding, validation and the CLI surface."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path

import httpx
import msgspec
import pytest

from pdgate.router.cli import build_parser, config_from_args, main
from pdgate.router.config import ConfigError, RouterConfig, load_config
from pdgate.router.config_checks import validate_config
from pdgate.router.policies import POLICIES
from tests.router.conftest import wait_until_ready
from tests.router.fake_engine import FakeEngine

NAMES = frozenset(POLICIES)


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "router.yaml"
    path.write_text(text)
    return path


def test_yaml_uses_struct_field_names(tmp_path: Path) -> None:
    path = write(tmp_path, """
model: /models/llama
prefill: [http://p0:8100, http://p1:8100]
decode: [http://d0:8200]
decode_policy: round-robin
prefill_timeout_s: 30
""")
    config = validate_config(load_config(path), NAMES)
    assert config.prefill == ["http://p0:8100", "http://p1:8100"]
    assert config.decode == ["http://d0:8200"]
    assert config.decode_policy == "round-robin"
    assert config.prefill_timeout_s == 30.0
    assert config.served_names == ["/models/llama"]
    assert config.tokenizer_source == "/models/llama"


def test_unknown_yaml_field_is_named(tmp_path: Path) -> None:
    path = write(tmp_path, "model: m\nprefil: [http://p:1]\n")
    with pytest.raises(ConfigError, match="unknown field `prefil`"):
        load_config(path)


def test_wrong_type_is_named(tmp_path: Path) -> None:
    path = write(tmp_path, "model: m\nport: eighty\n")
    named = r"--port \(YAML `port`, env PDGATE_PORT\): Expected `int`"
    with pytest.raises(ConfigError, match=named):
        load_config(path)


def test_a_missing_setting_is_named_as_flag_yaml_key_and_env(
    capsys: pytest.CaptureFixture[str]
) -> None:
    from pdgate.router.cli import main

    assert main(["--prefill", "http://127.0.0.1:1", "--decode", "http://127.0.0.1:2"]) == 2
    assert "missing required setting --model (YAML `model`, env PDGATE_MODEL)" \
        in capsys.readouterr().err


@pytest.mark.parametrize(("changes", "field"), [
    ({"prefill": []}, "prefill"),
    ({"decode": []}, "decode"),
    ({"decode": ["d0:8200"]}, "decode"),
    ({"prefill_policy": "randomly"}, "prefill_policy"),
    ({"connect_timeout_s": 0}, "connect_timeout_s"),
    ({"max_body_bytes": -1}, "max_body_bytes"),
    ({"max_model_len": 0}, "max_model_len"),
    ({"reserved_slots": 4, "max_concurrent_requests": 4}, "reserved_slots"),
    ({"reserved_slots": -1}, "reserved_slots"),
    ({"reserved_slots": 1, "admission_order": "fifo"}, "reserved_slots"),
])
def test_validation_names_the_field(changes: dict[str, object], field: str) -> None:
    base = {"model": "m", "prefill": ["http://p:1"], "decode": ["http://d:2"]}
    config = msgspec.convert({**base, **changes}, RouterConfig)
    with pytest.raises(ConfigError, match=f"^{field}:"):
        validate_config(config, NAMES)


def test_flags_override_yaml(tmp_path: Path) -> None:
    path = write(tmp_path, "model: m\nprefill: [http://p:1]\ndecode: [http://d:2]\nport: 1\n")
    config = config_from_args([
        "--config", str(path), "--port", "9000", "--decode", "http://d:3",
        "--decode", "http://d:4", "--prefill-policy", "least-inflight",
    ])
    assert config.port == 9000
    assert config.prefill == ["http://p:1"]
    assert config.decode == ["http://d:3", "http://d:4"]
    assert config.prefill_policy == "least-inflight"


def test_every_field_has_a_flag_with_help() -> None:
    parser = build_parser()
    flags = {a.dest: a for a in parser._actions if a.dest != "help"}
    for field in msgspec.structs.fields(RouterConfig):
        assert field.name in flags, field.name
    for dest, action in flags.items():
        assert action.help and len(action.help) > 10, dest
    help_text = parser.format_help()
    assert "--prefill-policy" in help_text and "least-inflight" in help_text


def test_main_reports_config_errors(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--model", "m", "--decode", "http://d:1"]) == 2
    assert "prefill" in capsys.readouterr().err


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
async def test_python_m_router_serves_and_stops_on_signal(
    signum: int,
    tiny_model_dir: Path, make_engine: Callable[..., Awaitable[FakeEngine]]
) -> None:
    p, d = await make_engine(), await make_engine()
    port = free_port()
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "pdgate.router", "--model", str(tiny_model_dir), "--prefill", p.url,
        "--decode", d.url, "--port", str(port), "--served-model-name", "tiny",
        "--log-level", "warning", cwd=Path(__file__).parents[2],
        env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])},
    )
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client:
            await wait_until_ready(client, proc)
            resp = await client.post("/v1/completions", json={"model": "tiny", "prompt": "x"})
            assert resp.status_code == 200
            assert resp.json()["choices"][0]["text"] == "Hello world!"
    finally:
        proc.send_signal(signum)
        assert await asyncio.wait_for(proc.wait(), 30) == 0


async def test_sigterm_drains_in_flight_requests_before_exiting(
    tiny_model_dir: Path, make_engine: Callable[..., Awaitable[FakeEngine]]
) -> None:
    """Graceful shutdown: a request already in flight when SIGTERM arrives still gets its
    full answer; then the process exits 0 and stops accepting connections."""
    p, d = await make_engine(), await make_engine(delay_s=1.5)
    port = free_port()
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "pdgate.router", "--model", str(tiny_model_dir), "--prefill", p.url,
        "--decode", d.url, "--port", str(port), "--served-model-name", "tiny",
        "--log-level", "warning", "--shutdown-timeout-s", "20",
        cwd=Path(__file__).parents[2],
        env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])},
    )
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=30) as client:
            await wait_until_ready(client, proc)
            slow = asyncio.create_task(
                client.post("/v1/completions", json={"model": "tiny", "prompt": "x"}))
            while not d.requests:  # the decode leg has started: the request is in flight
                await asyncio.sleep(0.02)
            proc.send_signal(signal.SIGTERM)
            resp = await slow
            assert resp.status_code == 200
            assert resp.json()["choices"][0]["text"] == "Hello world!"
        assert await asyncio.wait_for(proc.wait(), 30) == 0
        with pytest.raises(httpx.TransportError):
            httpx.get(f"http://127.0.0.1:{port}/health", timeout=2)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
