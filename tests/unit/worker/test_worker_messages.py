"""How a stage worker batches what it tells the supervisor (omnid.worker.reporter: post/flush,
in-process, on a real pipe where it matters when a message goes)."""

from __future__ import annotations

import multiprocessing
import pickle
from multiprocessing.connection import Connection

from omnid import protocol as P
from omnid.worker.reporter import _MAX_PACK, Reporter, _coalesce, _packs


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


# ------------------------------------------------------------------ when a message goes (a real pipe)


def _reporter() -> tuple[Reporter, Connection]:
    """A Reporter on the worker's end of a real duplex pipe (a socketpair), and the supervisor's end."""
    worker, supervisor = multiprocessing.Pipe()
    return Reporter(worker, lambda: None), supervisor


def _read(conn: Connection) -> list[object]:
    """Everything readable now, Batches unpacked."""
    out: list[object] = []
    while conn.poll(0.2):
        msg = conn.recv()
        out += list(msg.messages) if isinstance(msg, P.Batch) else [msg]
    return out


def test_an_idle_pipe_sends_a_step_at_once_even_when_more_steps_follow() -> None:
    r, sup = _reporter()
    r.post(P.Segment("a", 0, False, text="he"))
    r.flush(more_soon=True)                 # the first token never waits
    assert _read(sup) == [P.Segment("a", 0, False, text="he")]
    r.post(P.Segment("a", 1, False, text="llo"))
    r.flush(more_soon=True)                 # the supervisor read everything: idle, sent now
    assert _read(sup) == [P.Segment("a", 1, False, text="llo")]


def test_a_busy_pipe_sends_a_step_with_the_next_one_and_never_holds_longer() -> None:
    r, sup = _reporter()
    r.post(P.Segment("a", 0, False, text="a"))
    r.flush(more_soon=True)                 # sent, not read yet: the pipe is busy
    r.post(P.Segment("a", 1, False, text="b"))
    r.post(P.Segment("b", 1, False, text="x"))
    r.flush(more_soon=True)                 # held for the next step
    r.flush(more_soon=True)                 # (a flush with nothing new: still held)
    r.post(P.Segment("a", 2, False, text="c"))
    r.flush(more_soon=True)                 # still busy, but held one step already: sent together
    # (one write, but every token its own segment: a job's events count its tokens)
    assert _read(sup) == [P.Segment("a", 0, False, text="a"), P.Segment("a", 1, False, text="b"),
                          P.Segment("b", 1, False, text="x"), P.Segment("a", 2, False, text="c")]


def test_a_busy_pipe_holds_nothing_when_no_step_follows_or_the_message_must_go() -> None:
    r, sup = _reporter()
    r.post(P.Segment("a", 0, False, text="a"))
    r.flush(more_soon=True)                 # busy from here on (nothing read)
    r.post(P.Segment("a", 1, True, text="b"))
    r.flush(more_soon=False)                # no step follows: sent
    r.post(P.Segment("b", 0, False, text="first"))
    r.flush(more_soon=True)                 # a job's first token is never held
    r.post(P.Finished("a", 0.1))
    r.flush(more_soon=True)                 # nor anything but segments and progress
    assert _read(sup) == [P.Segment("a", 0, False, text="a"), P.Segment("a", 1, True, text="b"),
                          P.Segment("b", 0, False, text="first"), P.Finished("a", 0.1)]


def test_steps_an_engine_took_in_one_call_stay_their_own_segments() -> None:
    # vLLM's core in a process steps on while the worker's loop runs; one engine `step` then takes
    # several of its steps, and says where each ended: each token is still one segment event.
    r, sup = _reporter()
    r.post(P.Segment("a", 0, False, text="0"))      # sent at once, not read: the pipe is busy from here on
    r.post(P.Segment("a", 1, False, text="he"))
    r.post(P.Progress("a", 1, 10))
    r.end_step()
    r.end_step()                            # (an empty step: no cut of its own)
    r.post(P.Segment("a", 2, False, text="l"))
    r.post(P.Segment("a", 3, False, text="lo"))     # one step that said two: joined, as before
    r.end_step()
    r.post(P.Segment("a", 4, True, text="!"))
    r.flush()
    r.post(P.Segment("b", 1, False, text="x"))
    r.post(P.Segment("b", 2, False, text="y"))
    r.flush()                               # (the cuts went with the last flush)
    assert _read(sup) == [P.Segment("a", 0, False, text="0"),
                          P.Segment("a", 1, False, text="he"), P.Progress("a", 1, 10),
                          P.Segment("a", 2, False, text="llo", count=2), P.Segment("a", 4, True, text="!"),
                          P.Segment("b", 1, False, text="xy", count=2)]
