"""Stop strings across a migration's cut (router/engines/resume_text.py, resume_events.py).

The engines here are a model of what vLLM 0.32 streams for a request with stop strings,
written from its code (`BaseIncrementalDetokenizer.update` / `get_next_output_text`,
`check_stop_strings`, the completion server's chunk per output): a token's text appears
once its character is whole (tokenizers' DecodeStream holds a partial one back), the last
`max(len(stop)) - 1` characters wait while the request runs (none with
`include_stop_str_in_output`), a match cuts the text at its start (its end when included)
and finishes with "stop", the earliest-ending match wins. Styles: `vllm`, a chunk per token
(empty text when held back); `merged`, vLLM's when its reader lags (the output collector
merges two outputs into one chunk); `grouped`, a chunk only when there is text, listing
every id since the last one (the shim before it streamed as vLLM does).

Every test kills the leg after each possible number of chunks (and the continuation after
each possible number again) and checks what the client gets against the uninterrupted
stream: the same text, finish_reason and stop_reason; a continuation is a new engine run
over the tokens after the cut, checking only its own text, as a real one does. A cut that
left a split character or a lost character in the kept prefix would garble the text.
"""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from pdgate.router.engines.resume_events import ResumeEvents
from pdgate.router.engines.resume_text import StopRule
from pdgate.router.flows.base import StreamResult
from pdgate.router.flows.migration import MigrationMetrics, Migrator
from pdgate.router.flows.resume import continuation_body, declined, stop_rule
from pdgate.router.input.schema import ClientRequest
from tests.router.test_migration import _req

ID0 = 1000  # token i's id
PROMPT = 7  # prompt tokens
ERROR = b'data: {"error": {"message": "engine reset", "type": "x", "code": 502}}\n\n'


@dataclass
class Chunk:
    text: str
    ids: list[int]
    finish: str | None = None
    stop_reason: str | None = None


def engine(pieces: list[bytes], first: int, rule: StopRule, style: str) -> list[Chunk]:
    """A greedy run that generates `pieces[first:]` (token i's bytes) streamed in `style`;
    its text starts where `pieces[first]` does."""
    per_token = style != "grouped"
    raw, text, sent, ids, out = b"", "", 0, [], []
    for i in range(first, len(pieces)):
        ids.append(ID0 + i)
        raw += pieces[i]
        checked = len(text)
        decoded = raw.decode("utf-8", "replace")
        if not decoded.endswith("\ufffd"):  # DecodeStream: only whole characters
            text = decoded
        finish, reason = None, None
        best: tuple[int, int, str] | None = None
        for s in rule.strings:
            j = text.find(s, max(0, checked - len(s) + 1))
            if j >= 0 and (best is None or j + len(s) < best[1]):
                best = (j, j + len(s), s)
        if best is not None:
            text = text[:best[1] if rule.include else best[0]]
            finish, reason = "stop", best[2]
        elif i == len(pieces) - 1:
            finish = "length"
        end = len(text) if finish else len(text) - rule.hold
        delta = text[sent:end] if end > sent else ""
        sent = max(sent, end)
        if per_token or delta or finish:
            out.append(Chunk(delta, ids, finish, reason))
            ids = []
        if finish:
            break
    if style == "merged":  # vLLM's output collector merges outputs its reader lags behind
        pairs = [out[i:i + 2] for i in range(0, len(out), 2)]
        out = [Chunk("".join(c.text for c in p), [i for c in p for i in c.ids], p[-1].finish,
                     p[-1].stop_reason) for p in pairs]
    return out


def sse(c: Chunk, chat: bool = False) -> bytes:
    choice: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": c.finish,
                              "stop_reason": c.stop_reason, "token_ids": c.ids}
    if chat:
        choice["delta"] = {"content": c.text} if c.text else {}
    else:
        choice["text"] = c.text
    obj = {"id": "first", "object": "chat.completion.chunk" if chat else "text_completion",
           "created": 1, "model": "m", "choices": [choice]}
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


def usage(completion: int) -> bytes:
    obj = {"id": "x", "object": "text_completion", "created": 2, "model": "m", "choices": [],
           "usage": {"prompt_tokens": PROMPT + 1, "completion_tokens": completion,
                     "total_tokens": PROMPT + 1 + completion}}
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


@dataclass
class Seen:
    text: str = ""
    finish: str | None = None
    stop_reason: str | None = None
    completion_tokens: int | None = None
    router_stop: bool = False


def read(raw: bytes, engine_side: bool = False) -> Seen:
    """What a client reads from `raw` (`engine_side`: an engine's own stream, ids listed)."""
    seen = Seen()
    for block in raw.decode().split("\n\n"):
        if not block.startswith("data: {"):
            continue
        obj = json.loads(block[6:])
        assert "error" not in obj
        for c in obj["choices"]:
            assert engine_side or "token_ids" not in c
            seen.text += c.get("text") or (c.get("delta") or {}).get("content") or ""
            if c["finish_reason"] is not None:
                assert seen.finish is None, "two finish_reasons"
                seen.finish, seen.stop_reason = c["finish_reason"], c.get("stop_reason")
        if obj.get("usage"):
            seen.completion_tokens = obj["usage"]["completion_tokens"]
    return seen


def migrate(pieces: list[bytes], rule: StopRule, style: str, deaths: list[int],
            chat: bool = False) -> Seen:
    """The client's stream when the leg dies after `deaths[0]` chunks, its continuation
    after `deaths[1]`, ... (the last leg runs to its end)."""
    ev = ResumeEvents(chat=chat, wants_usage=True, stops=rule)
    chunks = engine(pieces, 0, rule, style)
    out, legs = b"", 0
    while True:
        k = deaths[legs] if legs < len(deaths) else len(chunks)
        out += ev.feed(b"".join(sse(c, chat and not legs) for c in chunks[:k]))
        if ev.stopped:
            out += ev.usage_event()
            break
        if k == len(chunks):
            out += ev.feed(usage(sum(len(c.ids) for c in chunks)))
            break
        out += ev.feed(ERROR)
        if ev.finished is not None:  # it had finished: only the usage was lost
            ev.bill_prompt(PROMPT)
            out += ev.usage_event()
            break
        kept = ev.clean
        assert ev.ids[:kept] == [ID0 + i for i in range(kept)]
        ev.continue_as(PROMPT)
        chunks = engine(pieces, kept, rule, style)
        legs += 1
    seen = read(out + ev.end())
    seen.router_stop = ev.stopped
    return seen


def tokens(*parts: str | bytes) -> list[bytes]:
    return [p.encode() if isinstance(p, str) else p for p in parts]


# The scenarios the issue names. Cuts fall everywhere, so each one also has cuts before,
# inside and after its stop string; the comments say which cuts make it interesting.
SCENARIOS = {
    # After the cut: the continuation's engine finds the match itself.
    "after": (tokens("The", " answer", " is", " 4", "2", ".", " Then", " we", " STOP",
                     " now", " ok"), StopRule(("STOP",))),
    # Across: "STOP" in four tokens; a cut inside it leaves the engine half of it.
    "across": (tokens("One", " two", " S", "T", "O", "P", " three", " four"),
               StopRule(("STOP",))),
    # Two strings; the shorter one ends first though it starts later (vLLM's rule).
    "earliest_end": (tokens("a", "b", "c", "d", "e", "f", "g", "h"),
                     StopRule(("bcde", "d"))),
    "earliest_end_across": (tokens("x", "y", "ab", "c", "d", "e", "f"),
                            StopRule(("bcdef", "cd"))),
    # Kept in the text.
    "include": (tokens("One", " two", " S", "T", "O", "P", " three"),
                StopRule(("STOP",), include=True)),
    "include_two": (tokens("a", "b", "c", "d", "e", "f", "g"),
                    StopRule(("cdef", "de"), include=True)),
    # Characters split over tokens, one inside the stop string.
    "multibyte": (tokens("caf", b"\xc3", b"\xa9", " ", b"\xe2\x82", b"\xac", "5", " d",
                         b"\xc3", b"\xa9j", b"\xc3\xa0", " vu", " fin"),
                  StopRule(("éjà",))),
    "multibyte_include": (tokens("\u00fcber", b"\xf0\x9f", b"\x98", b"\x80", " x", " y",
                                 " z"), StopRule(("r😀", "x y"), include=True)),
    # The token completing the match also begins a split character: its text (and so the
    # match) appears with the next token, for the engine as for the router.
    "split_after_match": (tokens("x", "a", b"b\xc3", b"\xa9c", "d", "e"),
                          StopRule(("ab",), include=True)),
    # Never matches: the held-back text must come out whole.
    "no_match": (tokens("Hello", " wor", "ld", ",", " how", " are", " you"),
                 StopRule(("never", "zz"))),
    # A stop string as long as the answer's first tokens, matching at the very start.
    "at_start": (tokens("ST", "OP", " more", " text"), StopRule(("STOP",))),
    # No stop strings: the cut at the last token whose text the client has.
    "none": (tokens("a", b"\xc3", b"\xa9", "b", "c", "d"), StopRule()),
}


@pytest.mark.parametrize("style", ["vllm", "merged", "grouped"])
@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_every_cut_gives_the_uninterrupted_stream(name: str, style: str) -> None:
    pieces, rule = SCENARIOS[name]
    whole = engine(pieces, 0, rule, style)
    want = read(b"".join(sse(c) for c in whole), engine_side=True)
    generated = sum(len(c.ids) for c in whole)
    stops_here = 0
    for k in range(len(whole) + 1):
        seen = migrate(pieces, rule, style, [k])
        where = f"{name}: died after {k} chunks"
        assert (seen.text, seen.finish, seen.stop_reason) == (
            want.text, want.finish, want.stop_reason), where
        # Billed as one run: a match found here appears with the token completing it
        # (nothing held back), so the tokens relayed are the tokens it had.
        assert seen.completion_tokens == generated, where
        stops_here += seen.router_stop
    # With the hold no match can span a cut the client has (resume_text's doc); without
    # it (included stop strings) some cut leaves a match half in the kept prefix (merged
    # chunks of two tokens make no cut points here but the start).
    if rule.include and style != "merged":
        assert stops_here, f"{name}: no cut left the match to the router"
    else:
        assert not stops_here, f"{name}: the router found a match the engine had checked"


@pytest.mark.parametrize("style", ["vllm", "merged", "grouped"])
@pytest.mark.parametrize("name", ["across", "multibyte", "include_two", "earliest_end"])
def test_a_continuation_that_dies_too_gives_the_uninterrupted_stream(
        name: str, style: str) -> None:
    pieces, rule = SCENARIOS[name]
    want = read(b"".join(sse(c) for c in engine(pieces, 0, rule, style)),
                engine_side=True)
    for k1 in range(len(pieces)):
        for k2 in range(len(pieces)):
            seen = migrate(pieces, rule, style, [k1, k2])
            assert (seen.text, seen.finish, seen.stop_reason) == (
                want.text, want.finish, want.stop_reason), f"{name}: died at {k1}, {k2}"


def test_a_chat_stream_stopped_across_the_cut_reads_as_chat() -> None:
    pieces, rule = SCENARIOS["include"]
    want = read(b"".join(sse(c) for c in engine(pieces, 0, rule, "vllm")), engine_side=True)
    # Nothing held back: after 4 chunks the client has "One two ST", the continuation
    # keeps those 4 tokens, its engine sees "OP three" and never "STOP".
    ev = ResumeEvents(chat=True, wants_usage=True, stops=rule)
    out = ev.feed(b"".join(sse(c, chat=True) for c in engine(pieces, 0, rule, "vllm")[:4]))
    out += ev.feed(ERROR)
    assert (ev.clean, ev.text.sent) == (4, len("One two ST"))
    ev.continue_as(PROMPT)
    out += ev.feed(b"".join(sse(c) for c in engine(pieces, 4, rule, "vllm")))
    assert ev.stopped
    out += ev.usage_event() + ev.end()
    events = [json.loads(b[6:]) for b in out.decode().split("\n\n") if b.startswith("data: {")]
    assert {e["object"] for e in events} == {"chat.completion.chunk"}
    assert {e["id"] for e in events} == {"first"}
    assert read(out).text == want.text == "One two STOP"
    assert events[-2]["choices"][0]["finish_reason"] == "stop"
    assert events[-2]["choices"][0]["stop_reason"] == "STOP"
    assert events[-1]["usage"]["prompt_tokens"] == PROMPT
    assert out.endswith(b"data: [DONE]\n\n")


@pytest.mark.parametrize(("body", "rule"), [
    ({}, StopRule()),
    ({"stop": "x"}, StopRule(("x",))),
    ({"stop": ["ab", "c"], "include_stop_str_in_output": True}, StopRule(("ab", "c"), True)),
    ({"stop": None}, StopRule()),
    ({"stop": [""]}, None),
    ({"stop": 5}, None),
    ({"stop": ["a", 1]}, None),
    ({"stop": "a", "include_stop_str_in_output": "yes"}, None),
])
def test_stop_strings_are_read_as_the_engine_reads_them(body: dict[str, Any],
                                                        rule: StopRule | None) -> None:
    assert stop_rule(_req(body)) == rule
    assert declined(_req({"max_tokens": 4, **body}), None) == (None if rule else "stop")


@pytest.mark.parametrize(("body", "reason"), [
    ({"stop": ["ab"], "temperature": 0}, None),
    ({"stop": ["ab"], "temperature": 0.7}, "stop"),  # the held-back "a" would be resampled
    ({"stop": ["ab"]}, "stop"),  # the engine's default temperature: sampling
    ({"stop": ["ab"], "temperature": 0.7, "include_stop_str_in_output": True}, None),
    ({"stop": ["a"], "temperature": 0.7}, None),  # one character: nothing held back
    ({"temperature": 0.7}, None),
])
def test_only_greedy_streams_migrate_with_text_held_back(body: dict[str, Any],
                                                         reason: str | None) -> None:
    assert declined(_req(body), None) == reason


def test_a_sampled_stream_keeps_every_token_the_client_has_text_of() -> None:
    # Its continuation samples anew: the cut must leave nothing for it to regenerate that
    # the client has, even after a chunk of two tokens.
    ev = ResumeEvents(chat=False, wants_usage=False, exact=False)
    ev.feed(sse(Chunk("ab", [ID0, ID0 + 1])) + sse(Chunk("", [ID0 + 2])) + ERROR)
    assert (ev.clean, ev.text.sent) == (2, 2)
    greedy = ResumeEvents(chat=False, wants_usage=False)
    greedy.feed(sse(Chunk("ab", [ID0, ID0 + 1])) + ERROR)
    assert greedy.clean == 0  # the second token might end inside a character


def test_a_chat_continuation_carries_the_stop_strings() -> None:
    req = _req({"max_completion_tokens": 9, "stop": ["END"],
                "include_stop_str_in_output": True}, chat=True)
    body = continuation_body(req, [1, 2, 3], 5)
    assert body["stop"] == ["END"] and body["include_stop_str_in_output"] is True


class _Leg:
    def __init__(self, pieces: bytes) -> None:
        self.pieces = pieces
        self.closed = self.finished = False

    async def chunks(self) -> AsyncGenerator[bytes, None]:
        for line in self.pieces.split(b"\n\n")[:-1]:
            yield line + b"\n\n"
        self.finished = True

    def close(self) -> None:
        self.closed = True


def _include_migrator(cont: list[_Leg]) -> Migrator:
    """A migrator whose continuations stream the "include" scenario after their cut."""
    pieces, rule = SCENARIOS["include"]

    async def run(req: ClientRequest, t0: float) -> StreamResult:
        kept = len(req.body["prompt"]) - PROMPT
        leg = _Leg(b"".join(sse(c) for c in engine(pieces, kept, rule, "vllm")) + usage(0))
        cont.append(leg)
        req.served_by["prefill"] = "p"
        return StreamResult(leg.chunks(), leg.close)

    async def tokenize(req: ClientRequest) -> None:
        req.prompt_token_ids = list(range(PROMPT))

    return Migrator(run, tokenize, MigrationMetrics.create(CollectorRegistry()), "pull",
                    max_migrations=2, deadline_s=30, max_model_len=None, non_streaming=True)


async def test_a_non_streaming_answer_stops_across_the_cut() -> None:
    pieces, rule = SCENARIOS["include"]
    first = engine(pieces, 0, rule, "vllm")
    cont: list[_Leg] = []
    m = _include_migrator(cont)
    req = _req({"max_tokens": len(pieces), "temperature": 0, "stop": "STOP",
                "include_stop_str_in_output": True, "stream": False})
    assert m.prepare(req) is None

    async def run(inner: ClientRequest) -> StreamResult:
        leg0 = _Leg(b"".join(sse(c) for c in first[:4]) + ERROR)
        return StreamResult(leg0.chunks(), leg0.close)

    body = json.loads(await m.answer(req, run))
    choice = body["choices"][0]
    assert (choice["text"], choice["finish_reason"], choice["stop_reason"]) == (
        "One two STOP", "stop", "STOP")
    assert body["usage"]["completion_tokens"] == 6
    assert len(cont) == 1 and cont[0].closed and not cont[0].finished


async def test_the_leg_is_closed_at_a_stop_string_across_the_cut() -> None:
    pieces, rule = SCENARIOS["include"]
    first = engine(pieces, 0, rule, "vllm")
    cont: list[_Leg] = []
    m = _include_migrator(cont)
    req = _req({"max_tokens": len(pieces), "temperature": 0, "stop": "STOP",
                "include_stop_str_in_output": True,
                "stream_options": {"include_usage": True}})
    assert m.prepare(req) is None and req.track_ids
    leg0 = _Leg(b"".join(sse(c) for c in first[:4]) + ERROR)
    result = m.wrap(req, StreamResult(leg0.chunks(), leg0.close), None)
    assert isinstance(result, StreamResult)
    raw = b"".join([p async for p in result.chunks])
    result.close()
    seen = read(raw)
    assert (seen.text, seen.finish, seen.stop_reason) == ("One two STOP", "stop", "STOP")
    # The continuation's engine would go on past the match: its leg was closed there, and
    # the router billed the tokens it had relayed (4 kept + "O", "P").
    assert len(cont) == 1 and cont[0].closed and not cont[0].finished
    assert seen.completion_tokens == 6
    assert raw.count(b"[DONE]") == 1
