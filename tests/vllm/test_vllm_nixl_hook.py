"""The vLLM venv's NIXL hook (tests/vllm/nixl_delay_site.py) does what the engines rely on:
with `PDGATE_NIXL_PTHR_NICE` the threads a NIXL agent starts (its busy progress thread and
UCX's) run at that nice value, so they yield the core to the engine's compute; with
`PDGATE_NIXL_PTHR_DELAY_US` the idle progress thread stops spinning. Push-mode engines
stalled when the renice missed the progress thread (it starts with the UCX backend)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from tests.vllm.processes import NIXL_PTHR_DELAY_US

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(120)]

# Starts one agent with the UCX backend, idles a second, then reports every thread the
# agent added: its nice value and the CPU seconds it used while idle.
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
print(json.dumps([{"nice": os.getpriority(os.PRIO_PROCESS, int(t)),
                   "idle_cpu_s": cpu(t) - start[t]} for t in new]))
"""


def agent_threads(python: Path, env: dict[str, str]) -> list[dict[str, float]]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("PDGATE_NIXL")}
    done = subprocess.run([str(python), "-c", PROBE], env={**base, "UCX_NET_DEVICES": "lo",
                          **env}, capture_output=True, text=True, timeout=90, check=True)
    threads: list[dict[str, float]] = json.loads(done.stdout.strip().splitlines()[-1])
    assert threads, "the agent started no threads"
    return threads


def test_nice_mode_renices_every_thread_the_agent_starts(vllm_python: Path) -> None:
    threads = agent_threads(vllm_python, {"PDGATE_NIXL_PTHR_NICE": "19"})
    assert [t["nice"] for t in threads] == [19] * len(threads)
    # The busy progress thread is among them: it spins even while the agent is idle.
    assert max(t["idle_cpu_s"] for t in threads) > 0.05


def test_delay_mode_keeps_an_idle_agent_off_the_cpu(vllm_python: Path) -> None:
    threads = agent_threads(vllm_python, {"PDGATE_NIXL_PTHR_DELAY_US": NIXL_PTHR_DELAY_US})
    assert sum(t["idle_cpu_s"] for t in threads) < 0.5
    assert {t["nice"] for t in threads} == {0}
