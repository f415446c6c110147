"""The shim's event loop stays free while it works: `GET /health` answers within 50 ms
while the shim tokenizes, prefills and hands over an 8,192-token prompt on CPU (prefill
role, pull mode, host staging and `--kv-digests`: the device-to-host copy and the hashing
of the handed-over blocks run in worker threads, the prompt is tokenized in one).

A real `python -m pdgate.engine_shim` process on 127.0.0.1 with the tiny model (its config
copied with a 16k context). A behavioural check of responsiveness, not a speed benchmark:
the prefill's own duration is not asserted, and the budget is on top of the slowest idle
/health of the same shim (what a loaded machine adds to every answer). Before the work
moved off the loop, tokenizing the prompt alone held the loop (and the GIL) for seconds.

One check in fifty may miss the budget, none by more than `LOOP_HOLD_S`: on 2 cores the
shim's event loop shares them with its 2 torch threads, the tokenizer's and the poller,
and CI saw one /health of 118 take 80 ms (the other 117 within budget, p50 2.4 ms), a
scheduler's delay a loop held by the shim's own work would not show as once."""

from __future__ import annotations

import json
import os
import shutil
import threading
import time
from pathlib import Path

import httpx
import pytest
from transformers import AutoTokenizer

from tests.engine_shim.process import MODEL, shim_process

PROMPT_TOKENS = 8192
HEALTH_BUDGET_S = 0.050
LOOP_HOLD_S = 0.25  # a loop held this long is the shim's doing on any machine


def _long_context_model(tiny: Path, into: Path) -> Path:
    shutil.copytree(tiny, into)
    config = json.loads((into / "config.json").read_text())
    config["max_position_embeddings"] = 16384  # rope is computed per position
    (into / "config.json").write_text(json.dumps(config))
    return into


def _prompt(model_dir: Path) -> str:
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    words = " ".join(f"item{i % 1000} of list {i % 37}," for i in range(PROMPT_TOKENS))
    ids = tok.encode(words, add_special_tokens=False)[:PROMPT_TOKENS]
    return str(tok.decode(ids))


def _overloaded() -> bool:
    """More runnable work than cores: every thread waits for a core, and a latency bound
    measures the machine, not the shim."""
    return os.getloadavg()[0] > (os.cpu_count() or 1)


def test_health_answers_within_50ms_during_a_long_prefill_and_hand_over(
        tiny_model_dir: Path, tmp_path: Path) -> None:
    model = _long_context_model(tiny_model_dir, tmp_path / "tiny-16k")
    prompt = _prompt(model)
    with shim_process(model, "--max-model-len", "16384", "--num-blocks", "1100",
                      "--side-channel-port", "0", "--kv-buffer-device", "cpu",
                      "--kv-digests", "--no-enable-prefix-caching", startup_s=300) as shim:
        if _overloaded():  # judged now, not when the suite was collected
            pytest.skip("the machine is overloaded (load > cores)")
        latencies: list[float] = []
        stop = threading.Event()

        def poll() -> None:
            with httpx.Client(timeout=5) as client:
                while not stop.is_set():
                    t0 = time.perf_counter()
                    assert client.get(shim.url + "/health").status_code == 200
                    latencies.append(time.perf_counter() - t0)
                    time.sleep(0.005)

        poller = threading.Thread(target=poll)
        poller.start()
        try:
            time.sleep(1.0)  # a baseline before the request
            idle = len(latencies)
            t0 = time.perf_counter()
            r = httpx.post(shim.url + "/v1/completions", timeout=300, json={
                "model": MODEL, "prompt": prompt, "max_tokens": 1,
                "kv_transfer_params": {"do_remote_decode": True}})
            took = time.perf_counter() - t0
        finally:
            stop.set()
            poller.join()
        assert r.status_code == 200, r.text[:300]
        body = r.json()
        assert body["usage"]["prompt_tokens"] >= PROMPT_TOKENS - 16
        assert body["kv_transfer_params"]["do_remote_prefill"] is True  # handed over
        transfers = httpx.get(shim.url + "/debug/kv_transfers", timeout=10).json()
        assert transfers["transfers"][-1]["digest"]  # hashed, off the loop
        assert len(latencies) >= took / 0.1, "too few health checks during the request"
        busy = latencies[idle:]
        baseline = max(latencies[:idle])
        slow = sorted((x for x in busy if x >= HEALTH_BUDGET_S + baseline), reverse=True)
        said = (f"slowest /health {max(busy) * 1000:.0f} ms, {len(slow)} over the budget "
                f"(p50 {_p50(busy) * 1000:.1f} ms, {len(busy)} checks over a {took:.1f} s "
                f"request; idle p50 {_p50(latencies[:idle]) * 1000:.1f} ms, slowest "
                f"{baseline * 1000:.0f} ms)")
        # On a quiet machine an idle /health takes ~1 ms; on a loaded one the scheduler's
        # delays come on top of the budget whatever the shim does.
        assert len(slow) <= max(1, len(busy) // 50), said
        assert not slow or slow[0] < LOOP_HOLD_S + baseline, said

def _p50(values: list[float]) -> float:
    return sorted(values)[len(values) // 2] if values else 0.0
