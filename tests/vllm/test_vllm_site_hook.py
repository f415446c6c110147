"""The vLLM venv's hook (tests/vllm/vllm_site_hook.py) does what the test engines rely on:
with `PDGATE_NIXL_PTHR_DELAY_US` an idle agent's progress thread stops spinning, so three
engines fit two cores; with `PDGATE_ENGINE_CORES` the core vLLM's NIXL worker reserves is the
engine's own; with `PDGATE_VLLM_MQ_SPIN_S=0` a message-queue reader waiting for its next
message blocks instead of spinning on `sched_yield`, and with `PDGATE_VLLM_MQ_RECHECK_MS`
looks at the queue again that often (a lost wake-up no longer costs 5 s). Without the
variables vLLM and nixl behave as shipped."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

from tests.vllm.processes import NIXL_PTHR_DELAY_US

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(120)]

# Starts one agent with the UCX backend, idles a second, then reports every thread the
# agent added and the CPU seconds it used while idle.
PROBE = """
import json, os, time
from nixl._api import nixl_agent, nixl_agent_config
before = set(os.listdir("/proc/self/task"))
agent = nixl_agent("probe", nixl_agent_config(backends=["UCX"]))
def cpu(tid):
    fields = open(f"/proc/self/task/{tid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
new = sorted(set(os.listdir("/proc/self/task")) - before)
start = {t: cpu(t) for t in new}
time.sleep(1.0)
print(json.dumps([{"idle_cpu_s": cpu(t) - start[t]} for t in new]))
"""


def run_probe(python: Path, probe: str, env: dict[str, str]) -> Any:
    """What `probe` printed last (JSON), run by `python` with the hook's variables `env`
    only (none inherited) and NIXL on loopback."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("PDGATE_")}
    done = subprocess.run([str(python), "-c", probe], env={**base, "UCX_NET_DEVICES": "lo",
                          **env}, capture_output=True, text=True, timeout=90, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def agent_threads(python: Path, env: dict[str, str]) -> list[dict[str, float]]:
    threads: list[dict[str, float]] = run_probe(python, PROBE, env)
    assert threads, "the agent started no threads"
    return threads


def test_the_delay_keeps_an_idle_agent_off_the_cpu(vllm_python: Path) -> None:
    delayed = agent_threads(vllm_python, {"PDGATE_NIXL_PTHR_DELAY_US": NIXL_PTHR_DELAY_US})
    busy = agent_threads(vllm_python, {})
    assert sum(t["idle_cpu_s"] for t in delayed) < 0.3
    # Without the variable the hook stays out: nixl's progress thread spins while idle.
    assert sum(t["idle_cpu_s"] for t in busy) > 0.3


# What vLLM's NIXL worker does on CPU (moves its thread to the last core), called from a
# module of its name, then from another module.
AFFINITY_PROBE = """
import json, os
reserve = "os.sched_setaffinity(0, {os.cpu_count() - 1})"
vllm_module = "vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_worker"
exec(reserve, {"os": os, "__name__": vllm_module})
pinned = sorted(os.sched_getaffinity(0))
exec(reserve, {"os": os, "__name__": "elsewhere"})
print(json.dumps([pinned, sorted(os.sched_getaffinity(0))]))
"""


def test_the_kv_transfer_core_vllm_reserves_is_the_engines_own(vllm_python: Path) -> None:
    pinned, elsewhere = run_probe(vllm_python, AFFINITY_PROBE, {"PDGATE_ENGINE_CORES": "0"})
    last = (os.cpu_count() or 1) - 1
    assert pinned == [0]
    assert elsewhere == [last]  # other callers keep their mask


# A reader of vLLM's shared-memory queue that has just read a message waits 0.5 s for the
# next one (none comes); prints the CPU seconds that wait took.
SPIN_PROBE = """
import json, time, zmq
from vllm.distributed.device_communicators.shm_broadcast import MessageQueue, SpinCondition
from vllm.utils.network_utils import get_open_zmq_ipc_path
ctx, address = zmq.Context(), get_open_zmq_ipc_path()
writer = SpinCondition(is_reader=False, context=ctx, notify_address=address)
reader = SpinCondition(is_reader=True, context=ctx, notify_address=address)
reader.record_read()
cpu, end = time.process_time(), time.monotonic() + 0.5
while time.monotonic() < end:
    reader.wait(timeout_ms=100)
spin_cpu_s = time.process_time() - cpu
# How long a reader with no deadline blocks before it looks at the queue again.
recheck_ms = MessageQueue.ReadTimeoutWithWarnings(None, should_warn=False).timeout_ms()
print(json.dumps([spin_cpu_s, recheck_ms]))
"""


def test_a_waiting_queue_reader_blocks_briefly_instead_of_spinning(vllm_python: Path) -> None:
    blocking, recheck_ms = run_probe(vllm_python, SPIN_PROBE, {
        "PDGATE_VLLM_MQ_SPIN_S": "0", "PDGATE_VLLM_MQ_RECHECK_MS": "2"})
    spinning, shipped_recheck_ms = run_probe(vllm_python, SPIN_PROBE, {})
    assert blocking < 0.1
    assert recheck_ms == 2
    # vLLM as shipped: the reader spins for its first second; a lost wake-up costs 5 s.
    assert spinning > 0.3
    assert shipped_recheck_ms == 5000
