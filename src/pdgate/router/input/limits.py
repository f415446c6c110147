"""Bounds on the work one client request can make the router do (hostile input).

- `InputLimits`: the settings below, taken from `RouterConfig` fields of the same names.
- `check_json_depth`: refuse deep nesting *before* msgspec decodes a body. msgspec recurses
  once per level (a 100k-deep body ends in RecursionError), so depth is counted with C-speed
  bytes operations instead: no Python loop over the body.

Client-supplied chat templates are bounded by router/input/template_sandbox.py (the render
budget) and router/input/template_workers.py (worker processes under a memory rlimit).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from pdgate.router.errors import InvalidRequest

if TYPE_CHECKING:
    from pdgate.router.config import RouterConfig

__all__ = ["MIB", "InputLimits", "check_json_depth"]

MIB = 1024 * 1024


@dataclass(frozen=True, slots=True)
class InputLimits:
    """Request-shape and chat-template bounds (defaults = `RouterConfig` defaults)."""

    max_json_depth: int = 32
    max_messages: int = 2048
    allow_client_chat_template: bool = False
    chat_template_timeout_s: float = 2.0
    chat_template_max_output_chars: int = 4 * MIB

    @classmethod
    def from_config(cls, config: RouterConfig) -> InputLimits:
        return cls(config.max_json_depth, config.max_messages,
                   config.allow_client_chat_template, config.chat_template_timeout_s,
                   config.chat_template_max_output_chars)



_BRACKETS = bytes.maketrans(b"{}", b"[]")  # depth does not care which kind
_NOT_STRUCTURE = bytes(b for b in range(256) if b not in b'[]{}"')


def check_json_depth(raw: bytes, max_depth: int) -> None:
    """Raise `InvalidRequest` when `raw` nests arrays/objects deeper than `max_depth`.

    Brackets inside strings do not count. Malformed JSON that is not deep passes (msgspec
    reports it); malformed JSON that could be deep is refused here.
    """
    if _at_most(raw, (b"[", b"{"), max_depth):
        return  # the usual body: too few brackets to be deep, wherever they are
    if b"\\" in raw:
        # Escaped backslashes first, then escaped quotes: every `"` left delimits a string.
        raw = raw.replace(b"\\\\", b"").replace(b'\\"', b"")
    marks = raw.translate(_BRACKETS, _NOT_STRUCTURE)  # only brackets and quotes are left
    # Adjacent quotes end one string and start the next (or delimit an empty one): the
    # usual strings, without brackets, go in one pass; the rest are cut out after.
    marks = marks.replace(b'""', b"")
    if b'"' in marks:
        marks = b"".join(marks.split(b'"')[::2])
    if _deeper_than(marks, max_depth):
        raise InvalidRequest(f"request body nests arrays/objects deeper than {max_depth} "
                             "levels")


def _at_most(raw: bytes, needles: tuple[bytes, ...], limit: int) -> bool:
    # Jumps from one occurrence to the next with find (memchr): a body without brackets
    # costs two scans at memory speed; bytes.count walks byte by byte, 40x slower.
    seen = 0
    for needle in needles:
        at = raw.find(needle)
        while at != -1:
            seen += 1
            if seen > limit:
                return False
            at = raw.find(needle, at + 1)
    return True


def _deeper_than(brackets: bytes, max_depth: int) -> bool:
    # Each round deletes the innermost pairs, one nesting level, in C: at most max_depth
    # passes over a string that holds only the brackets outside strings.
    too_deep = b"[" * (max_depth + 1)
    for _ in range(max_depth):
        if not brackets:
            return False
        if too_deep in brackets:
            return True
        shorter = brackets.replace(b"[]", b"")
        if len(shorter) == len(brackets):
            return False  # unbalanced and not deep: the decoder reports the syntax error
        brackets = shorter
    return bool(brackets)
