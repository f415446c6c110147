"""vllm-router's command line on `pdgate router`: its flags are mapped (with their units),
ignored with a warning or refused by name, and a router started with the command line from
vllm-router's docs serves. The migration page's table is checked against vllm-router's
documented flags (as data here) and pdgate's parser."""

from __future__ import annotations

import asyncio
import os
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path

import httpx
import pytest

from pdgate.router.cli import build_parser, config_from_args, main
from pdgate.router.cli_vllm import VLLM_FLAGS, migration_table
from pdgate.router.config import PolicySpec
from tests.router.conftest import wait_until_ready
from tests.router.fake_engine import FakeEngine
from tests.router.test_config import free_port

ROOT = Path(__file__).parents[2]
BASE = ["--model", "m", "--prefill", "http://p:1", "--decode", "http://d:2"]

# vllm-router's flags, from its docs/cli_reference.md (Rust binary and Python launcher),
# with a value each takes there (None: a switch).
VLLM_ROUTER_FLAGS: dict[str, str | None] = {
    "--host": "0.0.0.0", "--port": "30000", "--help": None, "--version": None,
    "--max-payload-size": "1048576", "--request-timeout-secs": "1800",
    "--max-concurrent-requests": "64", "--queue-size": "100", "--queue-timeout-secs": "60",
    "--rate-limit-tokens-per-second": "10", "--cors-allowed-origins": "https://a.example",
    "--worker-urls": "http://w:1", "--worker-startup-timeout-secs": "600",
    "--worker-startup-check-interval": "30", "--intra-node-data-parallel-size": "2",
    "--backend": "trtllm", "--runtime": "openai", "--mini-lb": None, "--enable-igw": None,
    "--history-backend": "memory", "--profile": None, "--policy": "cache_aware",
    "--prefill-policy": "round_robin", "--decode-policy": "power_of_two",
    "--cache-threshold": "0.3", "--balance-abs-threshold": "64",
    "--balance-rel-threshold": "1.5", "--eviction-interval": "120",
    "--eviction-interval-secs": "120", "--max-tree-size": "67108864",
    "--vllm-pd-disaggregation": None, "--prefill": "http://p:1", "--decode": "http://d:2",
    "--vllm-discovery-address": "0.0.0.0:30001", "--kv-connector": "mooncake",
    "--enable-program-scheduling": None, "--program-scheduling-config-json": "{}",
    "--service-discovery": None, "--selector": "app=w",
    "--service-discovery-port": "80", "--service-discovery-namespace": "ns",
    "--prefill-selector": "app=p", "--decode-selector": "app=d",
    "--retry-max-retries": "5", "--retry-initial-backoff-ms": "50",
    "--retry-max-backoff-ms": "30000", "--retry-backoff-multiplier": "1.5",
    "--retry-jitter-factor": "0.2", "--disable-retries": None,
    "--cb-failure-threshold": "10", "--cb-success-threshold": "3",
    "--cb-timeout-duration-secs": "60", "--cb-window-duration-secs": "120",
    "--disable-circuit-breaker": None, "--health-failure-threshold": "3",
    "--health-success-threshold": "2", "--health-check-timeout-secs": "5",
    "--health-check-interval-secs": "60", "--health-check-endpoint": "/healthz",
    "--log-dir": "/tmp", "--log-level": "warn", "--prometheus-port": "29000",
    "--prometheus-host": "127.0.0.1", "--request-id-headers": "x-my-id",
    "--enable-trace": None, "--otlp-traces-endpoint": "http://c:4318/v1/traces",
    "--otel-sampling-ratio": "0.5", "--otel-excluded-paths": "/health",
    "--api-key": "engine-secret", "--api-key-validation-urls": "http://v:1",
    "--wasm-middleware": "m.wasm", "--wasm-middleware-sha256": "ab",
    "--wasm-middleware-route": "/v1/chat/completions",
}


def test_every_vllm_router_flag_has_a_row_and_the_page_shows_the_table() -> None:
    assert [row.flag for row in VLLM_FLAGS] == list(VLLM_ROUTER_FLAGS)
    page = (ROOT / "docs" / "migrating-from-vllm-router.md").read_text()
    table = page.split("<!-- vllm-router-flags:begin -->\n", 1)[1].split("<!--", 1)[0]
    assert table == migration_table(), "regenerate the table from router/cli_vllm.py"


def test_the_pdgate_flags_named_in_the_table_exist() -> None:
    options = {s for a in build_parser()._actions for s in a.option_strings}
    for row in VLLM_FLAGS:
        for target in row.targets:
            assert target.split()[0] in options, (row.flag, target)
        if row.kind == "same":
            assert row.flag in options, row.flag


@pytest.mark.parametrize("flag", [f for f in VLLM_ROUTER_FLAGS if f not in ("--help",
                                                                         "--version")])
def test_pdgate_parses_every_vllm_router_flag(
    flag: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Each flag is either taken (a config comes out) or refused with its name."""
    value = VLLM_ROUTER_FLAGS[flag]
    argv = [*BASE, flag, *([value] if value is not None else [])]
    row = next(r for r in VLLM_FLAGS if r.flag == flag)
    if row.kind == "refused":
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert f"{flag} (vllm-router) is not supported" in err
    else:
        config_from_args(argv)
        if row.kind == "ignored":
            assert f"{flag} (vllm-router) is ignored" in capsys.readouterr().err


MAPPED = [
    (["--max-payload-size", "1048576"], {"max_body_bytes": 1048576}),
    (["--request-timeout-secs", "90"], {"prefill_timeout_s": 90.0,
                                        "decode_first_byte_timeout_s": 90.0}),
    (["--queue-size", "7", "--queue-timeout-secs", "3"], {"max_queued_requests": 7,
                                                          "queue_timeout_s": 3.0}),
    (["--worker-startup-timeout-secs", "20"], {"startup_wait_s": 20.0}),
    (["--policy", "consistent_hash"], {"prefill_policy": "consistent_hash",
                                       "decode_policy": "consistent_hash"}),
    (["--policy", "random", "--decode-policy", "cache_aware"],
     {"prefill_policy": "random", "decode_policy": "cache_aware"}),
    (["--decode-policy", "cache_aware", "--balance-abs-threshold", "32",
      "--balance-rel-threshold", "1.1"],
     {"prefill_policy": "round-robin", "decode_policy": PolicySpec(
         "prefix-text", params={"balance_abs_threshold": 32, "balance_rel_threshold": 1.1})}),
    (["--service-discovery", "--prefill-selector", "app=x", "role=p",
      "--decode-selector", "app=x,role=d", "--service-discovery-port", "8080",
      "--service-discovery-namespace", "llm"],
     {"discovery": "k8s", "prefill_selector": "app=x,role=p",
      "decode_selector": "app=x,role=d", "prefill_port": 8080, "decode_port": 8080,
      "namespace": "llm"}),
    (["--retry-max-retries", "3", "--retry-initial-backoff-ms", "50"],
     {"max_retries": 3, "retry_backoff_s": 0.05}),
    (["--disable-retries"], {"max_retries": 0}),
    (["--cb-failure-threshold", "10", "--cb-timeout-duration-secs", "60"],
     {"eject_consecutive_errors": 10, "breaker_open_s": 60.0}),
    (["--disable-circuit-breaker"], {"eject_consecutive_errors": 2**31 - 1}),
    (["--health-check-timeout-secs", "5", "--health-check-interval-secs", "60",
      "--health-failure-threshold", "3", "--health-success-threshold", "2"],
     {"health_timeout_s": 5.0, "health_interval_s": 60.0, "health_failure_threshold": 3,
      "health_success_threshold": 2}),
    (["--log-level", "warn"], {"log_level": "warning"}),
    (["--request-id-headers", "x-a", "x-b", "--cors-allowed-origins", "https://a.example"],
     {"request_id_headers": ["x-a", "x-b"], "cors_allowed_origins": ["https://a.example"]}),
    (["--prefill", "http://p2:1", "9000", "--prefill", "http://p3:1", "none"],
     {"prefill": ["http://p:1", "http://p2:1", "http://p3:1"]}),
    (["--vllm-pd-disaggregation", "--kv-connector", "nixl", "--backend", "vllm"],
     {"pd_mode": "pull"}),
]


@pytest.mark.parametrize(("flags", "expected"), MAPPED)
def test_vllm_router_flags_map_with_their_units(
    flags: list[str], expected: dict[str, object]
) -> None:
    config = config_from_args([*BASE, *flags])
    assert {k: getattr(config, k) for k in expected} == expected


def test_pdgate_flag_wins_over_the_vllm_router_spelling() -> None:
    config = config_from_args([*BASE, "--queue-size", "5", "--max-queued-requests", "9"])
    assert config.max_queued_requests == 9


def test_bootstrap_port_is_ignored_with_a_warning(capsys: pytest.CaptureFixture[str]) -> None:
    config_from_args(["--model", "m", "--prefill", "http://p:1", "9000", "--decode",
                      "http://d:2"])
    assert "bootstrap port is ignored" in capsys.readouterr().err
    assert main(["--model", "m", "--prefill", "http://p:1", "http://p:2", "--decode",
                 "http://d:2"]) == 2
    assert "URL [BOOTSTRAP_PORT|none]" in capsys.readouterr().err


def test_api_key_with_pd_flag_warns_about_its_meaning(
    capsys: pytest.CaptureFixture[str]
) -> None:
    config = config_from_args([*BASE, "--vllm-pd-disaggregation", "--api-key", "k" * 12])
    assert config.api_key == "k" * 12 and config.engine_api_key is None
    assert "--engine-api-key" in capsys.readouterr().err


async def test_the_command_line_from_vllm_routers_docs_serves(
    make_engine: Callable[..., Awaitable[FakeEngine]]
) -> None:
    """vllm-router's static P/D example (docs/cli_reference.md), URLs pointed at fake
    engines, the model given by env: a router process that serves, with `cache_aware`
    on the prefill leg (no tokenizer needed) and both prefills used."""
    p1, p2 = await make_engine(engine_id="P1"), await make_engine(engine_id="P2")
    d1, d2 = await make_engine(engine_id="D1"), await make_engine(engine_id="D2")
    port = free_port()
    argv = ["--vllm-pd-disaggregation", "--prefill", p1.url, "9000", "--prefill", p2.url,
            "none", "--decode", d1.url, "--decode", d2.url, "--prefill-policy",
            "cache_aware", "--decode-policy", "power_of_two"]
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "pdgate.router", *argv, "--port", str(port), cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT), "PDGATE_MODEL": "tiny"},
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client:
            await wait_until_ready(client, proc)
            for i in range(6):
                resp = await client.post("/v1/completions", json={
                    "model": "tiny", "prompt": f"{i} " * 300, "max_tokens": 2})
                assert resp.status_code == 200, resp.text
                assert resp.json()["choices"][0]["text"] == "Hello world!"
        assert len(p1.requests) + len(p2.requests) == 6 and p1.requests and p2.requests
        assert len(d1.requests) + len(d2.requests) == 6
    finally:
        proc.terminate()
        assert await asyncio.wait_for(proc.wait(), 30) == 0
    assert proc.stderr is not None
    assert b"bootstrap port is ignored" in await proc.stderr.read()
