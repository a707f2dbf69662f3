"""VllmEngine's wait on its engine core's output queue (a real queue.Queue, threads; no vLLM)."""

from __future__ import annotations

import queue
import threading
import time
from typing import Any

import pytest

from omnid.engines.vllm_engine import VllmEngine

pytestmark = pytest.mark.vllm


def engine_on(q: queue.Queue[Any]) -> VllmEngine:
    engine = object.__new__(VllmEngine)         # only the wait's state: no model, no core
    engine._core_outputs = q
    engine._woken = False
    return engine


def wait_in_thread(engine: VllmEngine) -> tuple[threading.Thread, list[bool]]:
    got: list[bool] = []
    t = threading.Thread(target=lambda: got.append(engine._wait_for_core()), daemon=True)
    t.start()
    time.sleep(0.05)
    return t, got


def test_the_wait_returns_when_the_core_has_outputs() -> None:
    q: queue.Queue[Any] = queue.Queue()
    engine = engine_on(q)
    t, got = wait_in_thread(engine)
    assert t.is_alive()                         # nothing yet: it waits
    q.put("outputs")
    t.join(2)
    assert got == [True] and q.qsize() == 1     # (the step takes them: the wait only looks)


def test_a_wake_ends_the_wait_without_outputs_once() -> None:
    q: queue.Queue[Any] = queue.Queue()
    engine = engine_on(q)
    t, got = wait_in_thread(engine)
    engine.wake()                               # from another thread: a cancel, a new job
    t.join(2)
    assert got == [False]
    t, got = wait_in_thread(engine)             # the wake is spent: the next wait waits again
    assert t.is_alive()
    q.put("outputs")
    t.join(2)
    assert got == [True]


def test_a_wake_before_the_wait_is_not_lost() -> None:
    q: queue.Queue[Any] = queue.Queue()
    engine = engine_on(q)
    engine.wake()
    assert engine._wait_for_core() is False


class _Core:
    """What `LLMEngine.step` does over a core in a process: one step's outputs off the queue."""

    def __init__(self, q: queue.Queue[Any]) -> None:
        self.q = q

    def step(self) -> list[Any]:
        return list(self.q.get())


def test_one_step_takes_every_step_the_core_has_made() -> None:
    # The core steps on while the worker's loop sends segments and windows: a step that took one of
    # its steps per turn of the loop would leave the loop ever further behind (a new request's first
    # token queued behind another's finished ones: 0.2-0.9 s at 3 speech streams).
    q: queue.Queue[Any] = queue.Queue()
    engine = engine_on(q)
    engine.engine = _Core(q)
    engine._watching, engine._forget, engine._requests = set(), [], {}
    ended: list[int] = []
    engine.on_step_ended(lambda: ended.append(q.qsize()))
    for _ in range(3):
        q.put([])
    engine.step()
    assert q.qsize() == 0
    # ... and tells the worker where each of them ended: a token stays one segment event
    assert ended == [0, 0]
