"""The standalone proxy process: starts, receives, reports metrics, stops on SIGTERM."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from pdgate.proxy import KVReady, NotifySender
from pdgate.proxy.cli import build_parser, config_from_args
from pdgate.proxy.wire import MAX_FRAME_BYTES

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        return str(resp.read().decode())


def test_every_flag_has_help() -> None:
    for action in build_parser()._actions:
        assert action.help, action.dest


def test_standalone_process_receives_and_stops_cleanly() -> None:
    mport = free_port()
    env = {**os.environ, "PDGATE_NOTIFY_SECRET": "standalone-secret-123"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "pdgate.proxy", "--bind", "tcp://127.0.0.1:0",
         "--metrics-port", str(mport), "--log-level", "WARNING"],
        stdout=subprocess.PIPE, text=True, cwd=ROOT, env=env,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline().split()
        assert line[0] == "listening", line
        with NotifySender(secret="standalone-secret-123") as sender:
            assert sender.send(line[1], KVReady(request_id="s-1"))
            want = 'pdgate_proxy_messages_total{kind="kv_ready",result="ok"} 1.0'
            deadline = time.monotonic() + 20
            while want not in scrape(mport):
                assert time.monotonic() < deadline, "notification never counted"
                time.sleep(0.05)
        assert "pdgate_proxy_early_arrivals 1.0" in scrape(mport)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_bad_setting_is_a_usage_error() -> None:
    out = subprocess.run([sys.executable, "-m", "pdgate.proxy", "--ttl-seconds", "0"],
                         capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert out.returncode == 2
    assert "ttl_s" in out.stderr


def test_frame_size_setting_reaches_the_config() -> None:
    args = build_parser().parse_args(["--max-frame-bytes", "4096"])
    assert config_from_args(args).max_frame_bytes == 4096
    assert config_from_args(build_parser().parse_args([])).max_frame_bytes == MAX_FRAME_BYTES


def test_standalone_help() -> None:
    out = subprocess.run([sys.executable, "-m", "pdgate.proxy", "--help"], capture_output=True,
                         text=True, timeout=60, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    for flag in ("--bind", "--notify-secret", "--ttl-seconds", "--max-early", "--max-waiters",
                 "--max-frame-bytes", "--log-level"):
        assert flag in out.stdout
