"""D's side of notify/push: waits for P's WRITE, ended by P's `landed` or `failed` notice.

One concurrent Future per tag (a reservation id in notify mode, the request id in push
mode), set by the agent thread when P's notice arrives, possibly before anyone waits for
it (bounded: the oldest unawaited entries go first). `awaiting()` is True while a tag is
still waited for, so the agent thread polls fast only then. Thread-safe.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, InvalidStateError

from pdgate.engine_shim.notices import Failed
from pdgate.engine_shim.transfer_errors import KVTransferError

__all__ = ["Landings"]

log = logging.getLogger(__name__)
_MAX_LANDINGS = 65536  # landing notices kept for requests nobody awaits yet (bounded)


class Landings:
    """See the module docstring. `wake()` nudges the agent thread into fast polling."""

    def __init__(self, wake: Callable[[], None]) -> None:
        self._wake = wake
        self._futures: OrderedDict[str, Future[tuple[int, ...]]] = OrderedDict()
        self._lock = threading.Lock()
        self._expected: set[str] = set()

    def __len__(self) -> int:
        return len(self._futures)

    def awaiting(self) -> bool:
        return bool(self._expected)

    def expect(self, tag: str) -> Future[tuple[int, ...]]:
        """A WRITE tagged `tag` is coming: poll fast until it lands."""
        fut = self._get(tag)
        with self._lock:
            if not fut.done():
                self._expected.add(tag)
        self._wake()
        return fut

    def forget(self, tag: str) -> None:
        with self._lock:
            self._futures.pop(tag, None)
            self._expected.discard(tag)

    def landed(self, tag: str, first_token_ids: tuple[int, ...]) -> None:
        """Agent thread: P's landed notice for `tag`."""
        fut = self._get(tag)
        with self._lock:
            self._expected.discard(tag)
        with contextlib.suppress(InvalidStateError):  # landed twice, or aborted meanwhile
            fut.set_result(first_token_ids)

    def failed(self, notice: Failed) -> None:
        """Agent thread: P says the WRITE tagged `notice.tag` will not land: fail the wait
        now. Only a landing we expect is failed (a stray notice must not poison a later
        request)."""
        with self._lock:
            fut = self._futures.get(notice.tag)
            self._expected.discard(notice.tag)
        if fut is None:
            log.debug("failed notice for %r, which nobody awaits; dropped", notice.tag)
            return
        log.warning("the prefill engine says the KV for %r will not land (%s: %s)",
                    notice.tag, notice.reason, notice.detail)
        with contextlib.suppress(InvalidStateError):  # landed or aborted meanwhile
            fut.set_exception(KVTransferError(
                f"the prefill engine will not push ({notice.reason}: {notice.detail})",
                reason="peer"))

    def abort(self, tag: str) -> None:
        """The router aborted the request: a wait for its push ends now."""
        with self._lock:
            fut = self._futures.get(tag)
        if fut is not None:
            with contextlib.suppress(InvalidStateError):  # it landed meanwhile
                fut.set_exception(KVTransferError("the router aborted the push",
                                                  reason="aborted"))

    async def wait(self, tag: str, timeout: float) -> tuple[int, ...]:
        """The tokens P named once the WRITE tagged `tag` landed; the entry is forgotten
        after. Raises KVTransferError: "timeout", "peer" (P's failed notice), "aborted"."""
        fut = self.expect(tag)
        try:
            return await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(fut)), timeout)
        except TimeoutError as e:
            raise KVTransferError(f"no KV landed for {tag!r} within {timeout:g}s",
                                  reason="timeout") from e
        finally:
            self.forget(tag)

    def _get(self, tag: str) -> Future[tuple[int, ...]]:
        with self._lock:
            fut = self._futures.get(tag)
            if fut is None:
                fut = self._futures[tag] = Future()
                while len(self._futures) > _MAX_LANDINGS:
                    old, _ = self._futures.popitem(last=False)
                    self._expected.discard(old)
            return fut
