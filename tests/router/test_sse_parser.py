"""`router.sse.EventChecker` (the engine SSE protocol check) and the linear-time line
buffering of both SSE classes: bytes pass through unchanged whatever the read boundaries,
every violation is refused, the stream ends at its `[DONE]` event (what follows is never
passed on, only noted), held bytes stay under the line limit."""

from __future__ import annotations

import time
from typing import Any

import pytest

from pdgate.router.engines.sse import EventChecker, SSELineTooLong, SSEProtocolError, UsageRewriter

GOOD = (
    b'data: {"choices":[{"text":"a"}]}\n\n'
    b": keep-alive comment\n\n"
    b'event: message\nid: 7\nretry: 10\ndata: {"choices":[{"text":"\\u00e9 \xc3\xa9"}]}\n\n'
    b'data:{"no":"space"}\r\n\r\n'
    b'data: {"choices":[],"usage":{"prompt_tokens":9,"completion_tokens":2}}\n\n'
    b"data: [DONE]\n\n"
)


def run(data: bytes, size: int, max_line: int = 1 << 20) -> bytes:
    checker = EventChecker(max_line)
    out = b"".join(checker.feed(data[i:i + size]) for i in range(0, len(data), size))
    return out + checker.end()


@pytest.mark.parametrize("size", [1, 2, 3, 7, 40, 200, len(GOOD)])
def test_valid_stream_passes_unchanged_whatever_the_reads(size: int) -> None:
    assert run(GOOD, size) == GOOD


def test_a_whole_event_is_passed_on_without_copying() -> None:
    checker = EventChecker(1 << 20)
    event = b'data: {"choices":[{"text":"tok"}]}\n\n'
    assert checker.feed(event) is event


def test_partial_lines_are_held_back_until_complete() -> None:
    checker = EventChecker(1 << 20)
    assert checker.feed(b'data: {"x":1}\n\ndata: {"y"') == b'data: {"x":1}\n\n'
    assert checker.feed(b":2") == b""
    assert checker.feed(b"}\n\ndata: [DO") == b'data: {"y":2}\n\n'
    assert checker.feed(b"NE]\n\n") == b"data: [DONE]\n\n"
    assert checker.end() == b""


def test_unterminated_done_at_the_end_is_accepted() -> None:
    checker = EventChecker(1 << 20)
    assert checker.feed(b'data: {"x":1}\n\ndata: [DONE]') == b'data: {"x":1}\n\n'
    assert checker.end() == b"data: [DONE]"


@pytest.mark.parametrize("bad", [
    b"data: not json\n\n",
    b"data: [1, 2]\n\n",
    b'data: "a string"\n\n',
    b"data: 42\n\n",
    b"data: \n\n",
    b'data: {"a":1} trailing\n\n',
    b'data: {"a":1}{"b":2}\n\n',
    b'data: {"a":"\xff"}\n\n',  # not UTF-8
    b'data: {"a":\r1}\n\n',  # a lone CR splits the line for the client
    b'{"choices":[]}\n\n',  # JSON where SSE was asked
    b"hello\n\n",
    b"<html>502 Bad Gateway</html>\n",
    b'data: {"a":' + b"[" * 5000 + b"]" * 5000 + b"}\n\n",  # past msgspec's depth budget
])
@pytest.mark.parametrize("size", [1, 5, 1000])
def test_violations_are_refused(bad: bytes, size: int) -> None:
    with pytest.raises(SSEProtocolError):
        run(b'data: {"ok":1}\n\n' + bad + b"data: [DONE]\n\n", size)


@pytest.mark.parametrize("size", [1, 9, 1000])
def test_a_stream_without_done_is_refused_at_its_end(size: int) -> None:
    data = b'data: {"ok":1}\n\ndata: {"ok":2}\n\n'
    checker = EventChecker(1 << 20)
    out = b"".join(checker.feed(data[i:i + size]) for i in range(0, len(data), size))
    assert out == data  # relayed as it came ...
    with pytest.raises(SSEProtocolError, match=r"without `data: \[DONE\]`"):
        checker.end()  # ... and refused at the end


def test_empty_stream_is_refused() -> None:
    with pytest.raises(SSEProtocolError):
        EventChecker(100).end()


@pytest.mark.parametrize("after", [
    b'data: {"late": 1}\n\n', b"event: late\n\n", b": bye\n\n", b"\n", b"oops",
    b"data: not json\n\n", b"x" * 5000,
])
@pytest.mark.parametrize("size", [1, 3, 7, 1000])
def test_the_stream_ends_at_its_done_event(after: bytes, size: int) -> None:
    # Whatever follows [DONE] is neither checked nor passed on, only noted: the relay
    # ends the client's stream there and does not reuse the engine's connection.
    head = b'data: {"ok":1}\n\ndata: [DONE]\n\n'
    checker = EventChecker(1000)
    data = head + after
    out = b"".join(checker.feed(data[i:i + size]) for i in range(0, len(data), size))
    assert out == head and checker.finished and checker.trailing
    assert checker.end() == b""


@pytest.mark.parametrize("size", [1, 5, 1000])
def test_a_done_event_is_finished_by_its_blank_line(size: int) -> None:
    done = b'data: {"ok":1}\n\ndata: [DONE]\r\n\r\n'
    checker = EventChecker(1000)
    out = b"".join(checker.feed(done[i:i + size]) for i in range(0, len(done), size))
    assert out == done and checker.finished and not checker.trailing
    # Another line right after `data: [DONE]`: the stream ends before it, with the blank
    # line a client's SSE parser needs to dispatch the [DONE] event.
    checker = EventChecker(1000)
    data = b"data: [DONE]\ndata: {}\n\n"
    out = b"".join(checker.feed(data[i:i + size]) for i in range(0, len(data), size))
    assert out == b"data: [DONE]\n\n" and checker.finished and checker.trailing


@pytest.mark.parametrize("size", [1, 10, 64, 5000])
def test_a_line_over_the_limit_is_refused(size: int) -> None:
    line = b'data: {"t":"' + b"x" * 200 + b'"}\n\n'
    assert run(line + b"data: [DONE]\n\n", size, max_line=len(line))  # at the limit: fine
    with pytest.raises(SSELineTooLong):
        run(b'data: {"ok":1}\n\n' + line + b"data: [DONE]\n\n", size, max_line=100)


def test_held_bytes_never_pass_the_limit() -> None:
    checker = EventChecker(1000)
    for _ in range(15):
        checker.feed(b"y" * 64)  # 960 bytes held
    with pytest.raises(SSELineTooLong):
        checker.feed(b"y" * 64)
    assert not checker._held


def test_a_long_line_costs_linear_time() -> None:
    # 16 MiB in 1 KiB reads: re-joining the held bytes on every read would copy ~128 GiB.
    piece = b"y" * 1024
    line_pieces = 16 * 1024
    checker = EventChecker(32 << 20)
    rewriter = UsageRewriter(lambda usage: None)
    head, tail = b'data: {"choices":[{"text":"', b'"}]}\n\ndata: [DONE]\n\n'
    t0 = time.perf_counter()
    checker.feed(head)
    rewriter.feed(b'data: {"usage":{},"text":"')
    for _ in range(line_pieces):
        assert checker.feed(piece) == b""
        assert rewriter.feed(piece) == b""
    out = checker.feed(tail)
    rewritten = rewriter.feed(b'"}\n\n')
    assert time.perf_counter() - t0 < 10
    assert len(out) == len(head) + 16 * 1024 * 1024 + len(tail) and checker.done
    assert len(rewritten) > 16 * 1024 * 1024


def test_usage_rewriter_any_chunking_after_the_checker() -> None:
    def fix(usage: dict[str, Any]) -> None:
        usage["prompt_tokens"] = 5

    for size in (1, 4, 33, len(GOOD)):
        checker, rewriter = EventChecker(1 << 20), UsageRewriter(fix)
        out = b"".join(rewriter.feed(checker.feed(GOOD[i:i + size]))
                       for i in range(0, len(GOOD), size))
        out += rewriter.feed(checker.end()) + rewriter.flush()
        assert b'"prompt_tokens":5' in out and b'"prompt_tokens":9' not in out
        assert out.replace(b'"prompt_tokens":5', b'"prompt_tokens":9') == GOOD


def test_a_read_of_whole_events_is_checked_at_once() -> None:
    # How a decode engine that is ahead of the relay sends: many events in one read.
    events = b'data: {"choices":[{"text":"a"}]}\n\n' * 16
    checker = EventChecker(1 << 20)
    assert checker.feed(events) is events
    assert checker.feed(events + b"data: [DONE]\n\n") == events + b"data: [DONE]\n\n"
    assert checker.done and checker.finished and not checker.trailing
    assert checker.feed(events) == b"" and checker.trailing  # after [DONE]: not passed on
