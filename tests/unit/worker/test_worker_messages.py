"""How a stage worker batches what it tells the supervisor (omnid.worker.reporter: post/flush, in-process)."""

from __future__ import annotations

import pickle

from omnid import protocol as P
from omnid.worker.reporter import _MAX_PACK, _coalesce, _packs


def test_consecutive_progress_of_a_job_keeps_the_last_and_segments_join() -> None:
    msgs: list[object] = [
        P.Progress("a", 1, 10), P.Segment("a", 0, False, text="he"), P.Progress("b", 1, 5),
        P.Segment("a", 1, False, text="llo"), P.Progress("b", 2, 5), P.Progress("b", 3, 5),
        P.Segment("b", 0, True, text=None), P.Segment("b", 1, True, text=None),
    ]
    out = _coalesce(msgs)
    assert out == [P.Progress("a", 1, 10), P.Segment("a", 0, False, text="hello", count=2),
                   P.Progress("b", 3, 5), P.Segment("b", 0, True, text=None, count=2)]


def test_coalescing_never_reorders_a_jobs_messages() -> None:
    msgs: list[object] = [P.Segment("a", 0, False, text="x"), P.Output("a", "o", "o.txt", "text", "text/plain", 1),
                          P.Segment("a", 1, True, text="y"), P.Finished("a", 0.1), P.Started("b")]
    assert _coalesce(msgs) == msgs


def test_batches_stay_small_enough_for_an_atomic_pipe_write() -> None:
    msgs: list[object] = [P.Segment(f"job{i}", 0, False, text=f"{i:03d}" + "w" * 300) for i in range(64)]
    packs = [pickle.loads(data) for data in _packs(msgs)]      # what the supervisor's recv() gets
    assert len(packs) > 1
    flat = [m for p in packs for m in (p.messages if isinstance(p, P.Batch) else (p,))]
    assert flat == msgs                                      # all of them, in order
    assert all(len(data) <= _MAX_PACK for data in _packs(msgs))
    assert [pickle.loads(d) for d in _packs([P.Started("a")])] == [P.Started("a")]   # one goes as itself
