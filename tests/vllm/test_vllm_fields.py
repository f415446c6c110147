"""OpenAI request fields through P/D with REAL vLLM engines (pull mode, NixlConnector).

A second router sends both legs through recording proxies (loopback HTTP, forwarding to
the session's P and D), so each test sees what P and D were asked, and compares the
client's answer with the colocated reference engine's (greedy: equal). The fields:

- `logprobs`/`top_logprobs` (completions and chat), `echo`, `stop`: disaggregated; P and D
  both get them (P samples one token that is discarded), D generates every token; but
  `echo` with `logprobs` (the prompt's logprobs) runs on D alone (the decider's
  `prompt_logprobs` rule: D loads the prompt's KV and computes no prompt logprobs);
- `tools` with `tool_choice` `required`, a named function and `auto`, streamed and not
  (the engines run vLLM's `pythonic` tool parser, tests/vllm/tool_calls.py; also through a
  notify-mode router, which runs the pull flow in front of vLLM), `response_format`
  `json_schema` and `structured_outputs` (`choice`, `regex`, `json`): disaggregated, the
  grammar runs on D from the first token, the output parses against the schema (even a
  random model complies with a constrained decoder);
- `n = 2` and a prompt batch: served by D alone (the decider's `n_gt_1` and
  `batch_prompt` rules: one set of P's blocks must not feed several children), P never
  sees them.

The early first token is not used for any of them (router/flows/early.py `eligible`).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from tests.e2e.cluster import metric
from tests.vllm.conftest import VllmCluster
from tests.vllm.processes import ENGINE_KEY, SERVED_NAME
from tests.vllm.recording import Proxies, Recorder
from tests.vllm.tool_calls import TOOL_CHOICES, check_tool_calls

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

HEADERS = {"Authorization": f"Bearer {ENGINE_KEY}"}
PROMPT = "The quick brown fox jumps over the lazy dog. Once upon a time"
CHAT = [{"role": "user", "content": "What is the weather like in Paris today?"}]
CITY_SCHEMA = {"type": "object", "properties": {
    "city": {"type": "string", "enum": ["Paris", "Rome"]},
    "sunny": {"type": "boolean"}}, "required": ["city", "sunny"],
    "additionalProperties": False}
DECISIONS = "pdgate_disagg_decisions_total"


@dataclass
class FieldsRig:
    router: str
    ref: str
    p: Recorder
    d: Recorder
    cluster: VllmCluster
    _notify: str | None = None

    def notify_router(self) -> str:
        """A `--pd-mode notify` router in front of the same recorders (started once)."""
        if self._notify is None:
            self._notify = self.cluster.start_router(
                "router-fields-notify", [self.p.url], [self.d.url],
                ["--pd-mode", "notify"]).url
        return self._notify


@pytest.fixture(scope="module")
def rig(vllm_cluster: VllmCluster) -> Iterator[FieldsRig]:
    proxies = Proxies([vllm_cluster.p.url, vllm_cluster.d.url])
    p, d = proxies.recorders
    try:
        # The early first token is on (the default): every request here is ineligible for
        # it (router/flows/early.py), so each runs the plain flow.
        router = vllm_cluster.start_router("router-fields", [p.url], [d.url])
        yield FieldsRig(router.url, vllm_cluster.ref.url, p, d, vllm_cluster)
    finally:
        proxies.close()


def post(url: str, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(url + path, json={"model": SERVED_NAME, **body}, headers=HEADERS,
                      timeout=300)


def both(rig: FieldsRig, path: str, body: dict[str, Any]) -> tuple[Any, Any]:
    """The router's answer and the colocated engine's, both 200."""
    via = post(rig.router, path, body)
    ref = post(rig.ref, path, body)
    assert via.status_code == 200, via.text
    assert ref.status_code == 200, ref.text
    return via.json(), ref.json()


def legs(rig: FieldsRig, path: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """The last bodies P and D received on `path`."""
    return rig.p.seen(path)[-1], rig.d.seen(path)[-1]


def same_fields(p: dict[str, Any], d: dict[str, Any], *keys: str) -> None:
    for key in keys:
        assert key in p and key in d, key
        assert p[key] == d[key], key
    assert p["max_tokens"] == 1 and p["kv_transfer_params"]["do_remote_decode"] is True
    assert d["kv_transfer_params"]["do_remote_prefill"] is True


def strip_ids(answer: dict[str, Any]) -> list[Any]:
    """What must be equal in two answers: the choices (ids and timestamps differ)."""
    choices: list[Any] = answer["choices"]
    for c in choices:
        c.pop("token_ids", None)
        c.get("message", {}).pop("reasoning_content", None)
        for call in (c.get("message") or {}).get("tool_calls") or []:
            call.pop("id", None)
    return choices


def close(a: Any, b: Any) -> None:
    """Equal, with logprob values within float noise."""
    if isinstance(a, float) and isinstance(b, float):
        assert a == pytest.approx(b, abs=1e-3)
    elif isinstance(a, dict) and isinstance(b, dict):
        assert a.keys() == b.keys()
        for k in a:
            close(a[k], b[k])
    elif isinstance(a, list) and isinstance(b, list):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            close(x, y)
    else:
        assert a == b


def test_completion_logprobs_and_stop(rig: FieldsRig) -> None:
    body = {"prompt": PROMPT, "max_tokens": 8, "temperature": 0, "logprobs": 2,
            "stop": [" the", "."]}
    via, ref = both(rig, "/v1/completions", body)
    close(strip_ids(via), strip_ids(ref))
    assert len(via["choices"][0]["logprobs"]["top_logprobs"][-1]) >= 2
    same_fields(*legs(rig, "/v1/completions"), "logprobs", "stop")


def test_completion_echo(rig: FieldsRig) -> None:
    body = {"prompt": PROMPT, "max_tokens": 6, "temperature": 0, "echo": True}
    via, ref = both(rig, "/v1/completions", body)
    assert strip_ids(via) == strip_ids(ref)
    assert via["choices"][0]["text"].startswith(PROMPT)
    same_fields(*legs(rig, "/v1/completions"), "echo")


def test_prompt_logprobs_run_on_decode_alone(rig: FieldsRig) -> None:
    """`echo` with `logprobs` needs the prompt's logprobs: D would load the prompt's KV
    instead of computing them (and vLLM 0.32's P stalls on such a prefill), so the router
    serves it on D alone."""
    p_before = len(rig.p.bodies)
    before = metric(rig.router, DECISIONS, 'reason="prompt_logprobs"')
    body = {"prompt": PROMPT, "max_tokens": 4, "temperature": 0, "logprobs": 1,
            "echo": True}
    via, ref = both(rig, "/v1/completions", body)
    close(strip_ids(via), strip_ids(ref))
    assert via["choices"][0]["text"].startswith(PROMPT)
    assert len(rig.p.bodies) == p_before
    assert metric(rig.router, DECISIONS, 'reason="prompt_logprobs"') == before + 1


def test_chat_logprobs_and_top_logprobs(rig: FieldsRig) -> None:
    body = {"messages": CHAT, "max_tokens": 6, "temperature": 0, "logprobs": True,
            "top_logprobs": 3}
    via, ref = both(rig, "/v1/chat/completions", body)
    close(strip_ids(via), strip_ids(ref))
    content = via["choices"][0]["logprobs"]["content"]
    assert len(content) == via["usage"]["completion_tokens"]
    assert all(len(t["top_logprobs"]) == 3 for t in content)
    same_fields(*legs(rig, "/v1/chat/completions"), "logprobs", "top_logprobs")


@pytest.mark.parametrize("kind", list(TOOL_CHOICES))
def test_tool_calls_answer_as_the_colocated_engine(rig: FieldsRig, kind: str) -> None:
    """`tools` with `tool_choice` `required`, a named function and `auto`, streamed and
    not: the colocated engine's answer, a forced call that fits the tool's schema, and
    both legs carried the tool fields (tests/vllm/tool_calls.py)."""
    check_tool_calls(rig.router, rig.ref, rig.p, rig.d, kind)


def test_tool_calls_through_notify_run_the_pull_flow(rig: FieldsRig) -> None:
    """A notify-mode router in front of vLLM (which cannot reserve D's blocks) serves
    each request with the pull flow, counted; a tool call comes out as colocated."""
    router = rig.notify_router()
    before = metric(router, "pdgate_fallbacks_total", 'reason="no_reserve"')
    check_tool_calls(router, rig.ref, rig.p, rig.d, "required")
    assert metric(router, "pdgate_fallbacks_total", 'reason="no_reserve"') == before + 2


def test_response_format_json_schema_parses(rig: FieldsRig) -> None:
    body = {"messages": CHAT, "max_tokens": 80, "temperature": 0,
            "response_format": {"type": "json_schema", "json_schema": {
                "name": "weather", "schema": CITY_SCHEMA, "strict": True}}}
    via, ref = both(rig, "/v1/chat/completions", body)
    assert strip_ids(via) == strip_ids(ref)
    if via["choices"][0]["finish_reason"] == "stop":  # not cut by max_tokens
        out = json.loads(via["choices"][0]["message"]["content"])
        assert out["city"] in ("Paris", "Rome") and isinstance(out["sunny"], bool)
    same_fields(*legs(rig, "/v1/chat/completions"), "response_format")


@pytest.mark.parametrize("constraint", [
    {"choice": ["yes", "no", "maybe"]},
    # Compact JSON that the schema accepts (a random model given the JSON grammar's free
    # whitespace may spend every token on spaces).
    {"regex": r'\{"city": "(Paris|Rome)", "sunny": (true|false)\}'},
    {"json": CITY_SCHEMA},
])
def test_structured_outputs_parse(rig: FieldsRig, constraint: dict[str, Any]) -> None:
    body = {"prompt": PROMPT, "max_tokens": 120, "temperature": 0,
            "structured_outputs": constraint}
    via, ref = both(rig, "/v1/completions", body)
    assert strip_ids(via) == strip_ids(ref)
    text = via["choices"][0]["text"]
    if "choice" in constraint:
        assert text in constraint["choice"]
    elif "regex" in constraint or via["choices"][0]["finish_reason"] == "stop":
        out = json.loads(text)
        assert out["city"] in ("Paris", "Rome") and isinstance(out["sunny"], bool)
    same_fields(*legs(rig, "/v1/completions"), "structured_outputs")


def test_n_2_and_a_prompt_batch_run_on_decode_alone(rig: FieldsRig) -> None:
    p_before = len(rig.p.bodies)
    n_gt_1 = metric(rig.router, DECISIONS, 'reason="n_gt_1"')
    batch = metric(rig.router, DECISIONS, 'reason="batch_prompt"')
    # Sampled, seeded: vLLM refuses n > 1 with greedy sampling.
    via, ref = both(rig, "/v1/completions", {"prompt": PROMPT, "max_tokens": 6,
                                             "temperature": 0.8, "seed": 7, "n": 2})
    assert len(via["choices"]) == 2 and strip_ids(via) == strip_ids(ref)
    prompts = [PROMPT, "Paged attention stores keys and values"]
    via, ref = both(rig, "/v1/completions", {"prompt": prompts, "max_tokens": 6,
                                             "temperature": 0})
    assert len(via["choices"]) == 2 and strip_ids(via) == strip_ids(ref)
    assert len(rig.p.bodies) == p_before  # P never saw either
    d_last = rig.d.seen("/v1/completions")[-1]
    assert d_last["prompt"] == prompts and "kv_transfer_params" not in d_last
    assert metric(rig.router, DECISIONS, 'reason="n_gt_1"') == n_gt_1 + 1
    assert metric(rig.router, DECISIONS, 'reason="batch_prompt"') == batch + 1
