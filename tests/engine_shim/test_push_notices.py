"""P's landed notice: D reads the tag and the token(s) P sampled from it, and a notice from a
P that names no token (or garbage) still reads as a landing, without tokens."""

from __future__ import annotations

from engine_shim.push import LANDED_PREFIX, landed_notice, parse_landed


def test_landed_notice_names_the_tag_and_p_tokens() -> None:
    notice = landed_notice("req-1@3", (17, 4))
    assert notice.startswith(LANDED_PREFIX)
    assert parse_landed(notice[len(LANDED_PREFIX):]) == ("req-1@3", (17, 4))


def test_a_notice_without_tokens_is_still_a_landing() -> None:
    assert landed_notice("req-2", ()) == LANDED_PREFIX + b"req-2"
    assert parse_landed(b"req-2") == ("req-2", ())


def test_garbage_token_lists_read_as_none() -> None:
    assert parse_landed(b"req-3\n1,x,3") == ("req-3", ())
