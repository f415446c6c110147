"""AgentThread: jobs run in order on one thread, and the poll tick follows new work at once
instead of sleeping out a long idle interval (a transfer posted by a job must be polled)."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest

from pdgate.engine_shim.agent_thread import AgentThread, AgentThreadStopped

IDLE_S = 30.0  # far longer than any wait below: a tick inside a wait was not the idle one


class _Ticks:
    def __init__(self) -> None:
        self.count = 0
        self.cond = threading.Condition()

    def __call__(self) -> float:
        with self.cond:
            self.count += 1
            self.cond.notify_all()
        return IDLE_S

    def wait_beyond(self, n: int, timeout: float = 5.0) -> bool:
        with self.cond:
            return self.cond.wait_for(lambda: self.count > n, timeout)


@pytest.fixture
def ticking() -> Iterator[tuple[AgentThread, _Ticks]]:
    ticks = _Ticks()
    thread = AgentThread("test-agent", ticks)
    thread.start()
    assert ticks.wait_beyond(0)  # the first tick runs at start, then it idles
    yield thread, ticks
    thread.stop()


def test_a_job_is_followed_by_a_tick(ticking: tuple[AgentThread, _Ticks]) -> None:
    thread, ticks = ticking
    seen = ticks.count
    assert thread.submit(lambda: threading.current_thread().name).result(5) == "test-agent"
    assert ticks.wait_beyond(seen), "the tick after a job waited out the idle interval"


def test_wake_ticks_an_idle_thread(ticking: tuple[AgentThread, _Ticks]) -> None:
    thread, ticks = ticking
    seen = ticks.count
    thread.wake()
    assert ticks.wait_beyond(seen), "wake() did not tick the idle thread"


def test_jobs_after_stop_fail_and_wake_is_harmless(
        ticking: tuple[AgentThread, _Ticks]) -> None:
    thread, _ = ticking
    thread.stop()
    thread.wake()
    with pytest.raises(AgentThreadStopped):
        thread.submit(lambda: None).result(5)
