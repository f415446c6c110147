"""The router's internal request ids: 32 hex digits, never repeated, also across the
batches `InternalIds` draws from the kernel at once."""

from __future__ import annotations

import re

from pdgate.router.request_ids import InternalIds, new_internal_id


def test_batched_ids_are_hex_and_never_repeat_across_batches() -> None:
    ids = InternalIds(batch=4)
    drawn = [ids.new() for _ in range(4 * 50 + 3)]  # 50 refills and a partial batch
    assert all(re.fullmatch(r"[0-9a-f]{32}", i) for i in drawn)
    assert len(set(drawn)) == len(drawn)


def test_two_sources_draw_different_ids() -> None:
    assert InternalIds().new() != InternalIds().new()
    assert re.fullmatch(r"[0-9a-f]{32}", new_internal_id())
