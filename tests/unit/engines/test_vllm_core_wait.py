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
