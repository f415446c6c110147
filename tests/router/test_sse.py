"""The SSE usage rewriter: bytes pass through untouched except usage objects, whatever
the chunk boundaries."""

from __future__ import annotations

import json
from typing import Any

import pytest

from pdgate.router.engines.sse import UsageRewriter

STREAM = (
    b'data: {"choices":[{"text":"a"}]}\n\n'
    b'data: {"choices":[{"text":"\\"usage\\" in text"}]}\n\n'
    b'data: {"choices":[],"usage":{"prompt_tokens":9,"completion_tokens":2}}\n\n'
    b"data: [DONE]\n\n"
)


def fix(usage: dict[str, Any]) -> None:
    usage["prompt_tokens"] = 5
    usage["total_tokens"] = 5 + usage["completion_tokens"]


@pytest.mark.parametrize("size", [1, 3, 7, 40, len(STREAM)])
def test_rewrite_any_chunking(size: int) -> None:
    rw = UsageRewriter(fix)
    out = b"".join(rw.feed(STREAM[i:i + size]) for i in range(0, len(STREAM), size))
    out += rw.flush()
    lines = out.split(b"\n\n")
    assert lines[0] == b'data: {"choices":[{"text":"a"}]}'
    assert lines[1] == b'data: {"choices":[{"text":"\\"usage\\" in text"}]}'
    assert json.loads(lines[2][6:])["usage"] == {
        "prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7}
    assert lines[3] == b"data: [DONE]"


def test_complete_lines_are_not_held_back() -> None:
    rw = UsageRewriter(fix)
    assert rw.feed(b'data: {"x":1}\n\ndata: {"y"') == b'data: {"x":1}\n\n'
    assert rw.feed(b":2}\n\n") == b'data: {"y":2}\n\n'
    assert rw.flush() == b""


def test_null_usage_and_garbage_pass_through() -> None:
    rw = UsageRewriter(fix)
    data = b'data: {"usage":null}\n\ndata: {"usage": broken\n\n'
    assert rw.feed(data) == data
