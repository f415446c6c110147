"""An engine's context-length refusal reaches clients as OpenAI's
`context_length_exceeded` (clients branch on it), other 4xx as `engine_rejected`;
`/v1/models` carries vLLM's `max_model_len`, `root` and `parent`."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest

from tests.router.conftest import MODEL, RunningRouter
from tests.router.fake_engine import FakeEngine

MakeEngine = Callable[..., Awaitable[FakeEngine]]
StartRouter = Callable[..., Awaitable[RunningRouter]]

VLLM_TOO_LONG = [
    "This model's maximum context length is 2048 tokens. However, you requested 2100 "
    "tokens (2000 in the messages, 100 in the completion). Please reduce the length of "
    "the messages or completion.",
    "The decoder prompt (length 5000) is longer than the maximum model length of 4096. "
    "Make sure that `max_model_len` is no smaller than the number of text tokens.",
    "'max_tokens' or 'max_completion_tokens' is too large: 4000. This model's maximum "
    "context length is 4096 tokens and your request has 100 input tokens (4000 > 4096 - "
    "100).",
]


@pytest.mark.parametrize("message", VLLM_TOO_LONG)
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
async def test_engine_context_length_400_keeps_openais_code(
    make_engine: MakeEngine, start_router: StartRouter, message: str, path: str
) -> None:
    p = await make_engine(fail_status=400, fail_message=message)
    d = await make_engine()
    router = await start_router([p], [d], tokenize_prompts="auto")
    body = {"model": MODEL, "max_tokens": 4, **(
        {"prompt": "hi"} if path == "/v1/completions" else
        {"messages": [{"role": "user", "content": "hi"}]})}
    resp = await router.client.post(path, json=body)
    assert resp.status_code == 400
    err = resp.json()["error"]
    assert err["code"] == "context_length_exceeded" and err["message"] == message


async def test_other_engine_400s_stay_engine_rejected(
    make_engine: MakeEngine, start_router: StartRouter
) -> None:
    p = await make_engine(fail_status=400, fail_message="temperature must be >= 0")
    router = await start_router([p], [await make_engine()], tokenize_prompts="auto")
    resp = await router.client.post("/v1/completions", json={"model": MODEL, "prompt": "x"})
    assert resp.status_code == 400 and resp.json()["error"]["code"] == "engine_rejected"


async def test_models_have_vllms_fields(
    make_engine: MakeEngine, start_router: StartRouter, tiny_model_dir: Path
) -> None:
    router = await start_router([await make_engine()], [await make_engine()],
                                served_model_name=[MODEL, "alias"], max_model_len=512)
    data = (await router.client.get("/v1/models")).json()["data"]
    for card in data:
        assert card["max_model_len"] == 512
        assert card["root"] == str(tiny_model_dir) and card["parent"] is None
    one = (await router.client.get("/v1/models/alias")).json()
    assert one["id"] == "alias" and one["max_model_len"] == 512
