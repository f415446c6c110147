"""A relayed piece's usage lines are found from the first line that mentions usage
(`split_at_usage`): the rewriter and the usage-event strip give, on every piece, exactly
what a look at each of its lines gives (the rule spelled out here line by line)."""

from __future__ import annotations

import itertools
from typing import Any

import msgspec
import pytest

from pdgate.router.engines.sse import UsageRewriter, split_at_usage, strip_usage_events

TEXT = b'data: {"choices":[{"index":0,"text":" tok"}]}'
QUOTED = b'data: {"choices":[{"index":0,"text":"\\"usage\\" said"}]}'  # "usage" in a text
USAGE = b'data: {"choices":[],"usage":{"prompt_tokens":9,"completion_tokens":2}}'
WITH_USAGE = b'data: {"choices":[{"index":0,"text":"x"}],"usage":{"prompt_tokens":1}}'
NULL_USAGE = b'data: {"choices":[],"usage":null}'
BROKEN = b'data: {"usage": broken'
DONE = b"data: [DONE]"
LINES = (TEXT, QUOTED, USAGE, WITH_USAGE, NULL_USAGE, BROKEN, DONE, b": comment")


def fix(usage: dict[str, Any]) -> None:
    usage["prompt_tokens"] = 5


def by_line_strip(lines: bytes) -> bytes:
    """The usage-only event and its blank line dropped, each line looked at."""
    out: list[bytes] = []
    dropped = False
    for line in lines.split(b"\n"):
        if dropped and not line:
            dropped = False
            continue
        dropped = line.startswith(b"data: ") and b'"usage"' in line and _usage_only(line)
        if not dropped:
            out.append(line)
    return b"\n".join(out)


def _usage_only(line: bytes) -> bool:
    try:
        event = msgspec.json.decode(line[6:])
    except msgspec.DecodeError:
        return False
    return isinstance(event, dict) and event.get("choices") == [] and "usage" in event


def by_line_rewrite(lines: bytes) -> bytes:
    rw = UsageRewriter(fix)
    return b"\n".join(rw.rewrite(line) for line in lines.split(b"\n"))


def pieces() -> list[bytes]:
    """Pieces of one to three events (each line then a blank line, or the last without):
    every order of one or two of the lines above, of three of the main kinds."""
    out = []
    combos = itertools.chain(itertools.permutations(LINES, 1), itertools.permutations(LINES, 2),
                             itertools.permutations((TEXT, USAGE, WITH_USAGE, DONE), 3))
    for combo in combos:
        events = b"\n\n".join(combo)
        out += [events, events + b"\n\n", events + b"\n", b"\n" + events]
    return out


@pytest.mark.parametrize("lines", pieces())
def test_strip_and_rewrite_equal_a_look_at_every_line(lines: bytes) -> None:
    assert strip_usage_events(lines) == by_line_strip(lines)
    assert UsageRewriter(fix).rewrite(lines) == by_line_rewrite(lines)


def test_the_cut_is_before_the_first_usage_line() -> None:
    piece = TEXT + b"\n\n" + TEXT + b"\n\n" + USAGE + b"\n\n" + DONE + b"\n\n"
    head, rest = split_at_usage(piece)
    assert head == (TEXT + b"\n\n" + TEXT + b"\n",)
    assert rest == USAGE + b"\n\n" + DONE + b"\n\n"
    assert split_at_usage(USAGE + b"\n\n") == ((), USAGE + b"\n\n")
    assert split_at_usage(TEXT) == ((), TEXT)  # no usage: nothing to cut
    assert strip_usage_events(piece) == TEXT + b"\n\n" + TEXT + b"\n\n" + DONE + b"\n\n"
