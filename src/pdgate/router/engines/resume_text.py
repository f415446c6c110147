"""The text of a migrating stream (router/engines/resume_events.py reads its chunks): where
a continuation may start, which of its text the client has already, and the stop strings
that span the cut.

What the engines send. vLLM 0.32 (`BaseIncrementalDetokenizer`: `stop_buffer_length`,
`get_next_output_text`) and the shim hold back the last `hold = max(len(stop)) - 1`
characters of a request's text while it runs (none without stop strings or with
`include_stop_str_in_output`), and the text of a token that ends inside a multi-byte
character until the character is whole; the held text comes with the final chunk. The ids
are not held: both list each token's id in a chunk of its own, with empty text if need be
(an engine that listed held-back ids with its next chunk of text would be read alike: such
a chunk of several tokens is no mark, below). So the client's text does not
end where its tokens do, but one thing is exact: when a chunk listing exactly one id has
text, that token ended on a whole character (the text grew with it) and the engine's text
of every token so far is `hold` characters longer than what it has sent. Such a point is a
`Mark`: the first `ids` tokens have `pos` characters of text.

The cut. A continuation keeps the tokens of the last mark whose text the client has whole
(`pos <= sent`; none: the original prompt alone) and generates the rest again (greedy
decoding gives the same tokens); the client already has the first `sent - pos` characters
of its text, which are dropped. A chunk of several tokens with text (vLLM merges outputs
when its reader lags) is no mark: its last token may end inside a character whose text is
still held back. A sampled stream (not `exact`) takes marks there too: its continuation
generates other tokens, so it must keep every token the client has text of (with no hold,
all but a split character's; a sampled stream with a hold does not migrate, flows/resume.py).

Stop strings across the cut. The continuation's engine checks stop strings in its own text
only, which starts at the cut. With the hold, no match can span a cut the client has: the
failed leg's engine had checked its text `hold` characters beyond the client's, so a match
that starts before the cut (at most `hold + 1` characters long) ended within what it
checked, and it would have finished there. Without the hold (`include_stop_str_in_output`)
a match may start in the last `reach = max(len(stop)) - 1` characters before the cut and
end in the continuation's text. It is found here, on the client's tail plus the
continuation's text: the text ends there (at the match's end, or its start for an engine
that held back less than it should), the stream finishes with `finish_reason` "stop" and
`stop_reason` the string, as one engine would have done (the earliest-ending match wins,
ties by list order: vLLM's `check_stop_strings`). Such a match ends in text the client has
not had (the failed leg's engine checked all it sent), so nothing sent is taken back.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

__all__ = ["Mark", "StopRule", "StreamText"]


@dataclass(frozen=True, slots=True)
class StopRule:
    """A request's stop strings (vLLM `stop`) and `include_stop_str_in_output`."""

    strings: tuple[str, ...] = ()
    include: bool = False

    @property
    def reach(self) -> int:
        """Characters before a cut in which a match across it may start."""
        return max(map(len, self.strings), default=1) - 1

    @property
    def hold(self) -> int:
        """Characters an engine holds back while the request runs."""
        return 0 if self.include else self.reach


@dataclass(frozen=True, slots=True)
class Mark:
    """The first `ids` generated tokens have `pos` characters of text, whole."""

    ids: int
    pos: int


class StreamText:
    """One client stream's text across its legs (see the module doc). Per chunk of the
    current leg, `take` turns the engine's text into the client's; `restart` starts a
    continuation at `cut`. Positions count characters of the whole answer. `exact`
    (greedy decoding): a mark only after a chunk of one token; otherwise after any chunk
    with text (see the module doc)."""

    def __init__(self, rule: StopRule, *, exact: bool = True) -> None:
        self.rule = rule
        self.exact = exact
        self.sent = 0  # characters the client has
        self.stop: str | None = None  # a match across a cut, found here
        # Marks as (ids, pos) tuples, read once per chunk (a Mark costs more to make).
        self._cut = (0, 0)  # where a continuation would start now (`cut`)
        self._pending: deque[tuple[int, int]] = deque()  # marks beyond what the client has
        self._hold = rule.hold  # the rule's, computed once
        self._reach = rule.reach
        self._engine = 0  # end of the text the current leg's engine has sent
        self._tail = ""  # the client's text from `_tail_at` to `sent`
        self._tail_at = 0
        self._scan: _Scan | None = None

    @property
    def cut(self) -> Mark:
        """Where a continuation would start now."""
        return Mark(*self._cut)

    def take(self, text: str, ids: int, total_ids: int, finished: bool) -> str:
        """The client's part of `text`, a chunk's text from the current leg's engine
        (`ids` listed in the chunk, `total_ids` generated so far, `finished`: the chunk has
        a finish_reason). Sets `stop` when a match across the cut ends the stream here."""
        start = self._engine
        end = self._engine = start + len(text)
        if text and not finished and (ids == 1 or not self.exact):
            self._pending.append((total_ids, end + self._hold))
        if self._scan is not None:
            end = self._scanned(text, end)
        sent = self.sent
        # Most chunks go to the client whole (the slice below would copy them).
        out = (text if sent <= start and end >= self._engine
               else text[max(0, sent - start):max(0, end - start)])
        sent = self.sent = sent + len(out)
        pending = self._pending
        while pending and pending[0][1] <= sent:
            self._cut = pending.popleft()
        if self.rule.strings:
            self._keep_tail(out)
        return out

    def _scanned(self, text: str, end: int) -> int:
        """`take`'s end of the client's text once the search across the cut saw `text`."""
        scan = self._scan
        assert scan is not None
        found = scan.feed(text, self.rule)
        if found is not None:
            self.stop, end = found[0], max(found[1], self.sent)
        if found is not None or self._engine >= scan.cut + self._reach:
            self._scan = None  # no match across the cut can end later
        return end

    def restart(self) -> Mark:
        """A continuation starts at `cut` (returned): its engine's text begins there."""
        self._pending.clear()
        pos = self._engine = self._cut[1]
        self._scan = None
        if self.rule.strings:
            keep = self._tail[max(0, pos - self._reach - self._tail_at):pos - self._tail_at]
            self._scan = _Scan(pos, keep)
        return self.cut

    def _keep_tail(self, out: str) -> None:
        # Keep the client's text from `reach` characters before the cut: the window a
        # continuation's match across the cut may start in.
        self._tail += out
        drop = self._cut[1] - self._reach - self._tail_at
        if drop > 0:
            self._tail = self._tail[drop:]
            self._tail_at += drop


class _Scan:
    """The search for a match across a cut at `cut`: the client's text before it, then
    the continuation's (`text`, which begins `split` characters in)."""

    def __init__(self, cut: int, before: str) -> None:
        self.cut = cut
        self.text = before
        self.split = len(before)

    def feed(self, more: str, rule: StopRule) -> tuple[str, int] | None:
        """Add the continuation's `more`; a match that starts before the cut: the stop
        string and where the text ends (its start, or its end when included)."""
        self.text += more
        best: tuple[int, int, str] | None = None
        for s in rule.strings:
            i = self.text.find(s)
            while 0 <= i < self.split:
                end = i + len(s)
                if end > self.split and (best is None or end < best[1]):
                    best = (i, end, s)
                    break
                i = self.text.find(s, i + 1)
        if best is None:
            return None
        i, end, s = best
        at = self.cut - self.split + (end if rule.include else i)
        return s, at
