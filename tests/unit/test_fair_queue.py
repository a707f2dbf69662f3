"""omnid/fair_queue.py: ranks (priority, fair share by weight) and the ranked, bounded queue."""

from __future__ import annotations

import queue
import threading
import time
from collections import Counter

import pytest

from omnid.fair_queue import FairShare, RankedQueue, positions, take_key

Item = tuple[str, tuple[int, float, int], float]      # (name, rank, since)


def ranked(maxsize: int = 0, max_wait_s: float = 0.0) -> RankedQueue[Item]:
    return RankedQueue(maxsize, lambda i: i[1], lambda i: i[2], lambda: max_wait_s)


def test_priority_levels_are_strict_and_ties_go_in_admission_order() -> None:
    fair = FairShare()
    q = ranked()
    for name, prio in [("a", 0), ("b", 5), ("c", -1), ("d", 0), ("e", -2)]:
        q.put((name, fair.rank(prio, "uid:0", 1.0), time.time()))
    assert [q.get()[0] for _ in range(5)] == ["e", "c", "a", "d", "b"]


def test_fair_share_serves_owners_in_proportion_to_their_weights() -> None:
    fair = FairShare()
    q = ranked()
    for owner, weight, n in [("A", 1.0, 300), ("B", 2.0, 300), ("C", 3.0, 300)]:     # A queued all first
        for _ in range(n):
            q.put((owner, fair.rank(0, owner, weight), time.time()))
    taken = []
    for _ in range(300):
        item = q.get()
        fair.started(item[1])
        taken.append(item[0])
    counts = Counter(taken)
    assert counts["A"] == pytest.approx(50, abs=2) and counts["B"] == pytest.approx(100, abs=2) \
        and counts["C"] == pytest.approx(150, abs=2), counts


def test_a_newcomer_goes_next_not_behind_another_owners_backlog() -> None:
    fair = FairShare()
    q = ranked()
    for _ in range(200):
        q.put(("A", fair.rank(0, "A", 1.0), time.time()))
    for _ in range(3):
        fair.started(q.get()[1])
    q.put(("B", fair.rank(0, "B", 1.0), time.time()))
    order = [q.get()[0] for _ in range(3)]
    assert "B" in order[:2], order


def test_fair_share_off_is_arrival_order_within_a_level() -> None:
    fair = FairShare()
    q = ranked()
    for i in range(5):
        q.put(("A" if i < 4 else "B", fair.rank(0, "A" if i < 4 else "B", 1.0, fair=False), time.time()))
    assert [q.get()[0] for _ in range(5)] == ["A", "A", "A", "A", "B"]


def test_a_job_that_waited_max_wait_s_goes_before_more_urgent_ones() -> None:
    q = ranked(max_wait_s=10.0)
    now = time.time()
    q.put(("old-low", (5, 0.0, 1), now - 11))
    q.put(("urgent", (-5, 0.0, 2), now))
    assert q.get()[0] == "old-low"
    assert positions([("x", (5, 0.0, 1), now - 11), ("y", (-5, 0.0, 2), now)], now, 10.0) == ["x", "y"]
    assert positions([("x", (5, 0.0, 1), now - 1), ("y", (-5, 0.0, 2), now)], now, 10.0) == ["y", "x"]


def test_the_bound_is_on_places_and_an_item_waiting_for_one_is_taken_by_rank() -> None:
    q = ranked(maxsize=1)
    q.put(("low", (5, 0.0, 1), 0.0))
    with pytest.raises(queue.Full):
        q.put_nowait(("x", (0, 0.0, 2), 0.0))
    with pytest.raises(queue.Full):
        q.put(("x", (0, 0.0, 2), 0.0), timeout=0.05)
    assert q.qsize() == 1
    ticket = q.offer(("urgent", (-1, 0.0, 3), 0.0))        # its sender waits for a place ...
    assert not q.admitted(ticket, timeout=0.01)
    assert q.get()[0] == "urgent"                            # ... but it is taken first
    assert q.admitted(ticket, timeout=0)
    t2 = q.offer(("later", (9, 0.0, 4), 0.0))
    assert q.withdraw(t2) and not q.withdraw(t2)
    assert q.get()[0] == "low"
    with pytest.raises(queue.Empty):
        q.get(timeout=0.01)


def test_a_waiting_sender_gets_its_place_when_one_is_freed() -> None:
    q = ranked(maxsize=1)
    q.put(("a", (0, 0.0, 1), 0.0))
    done = threading.Event()

    def sender() -> None:
        q.put(("b", (0, 0.0, 2), 0.0), timeout=5)
        done.set()
    t = threading.Thread(target=sender)
    t.start()
    time.sleep(0.05)
    assert not done.is_set()
    assert q.get()[0] == "a"
    assert done.wait(2)
    t.join()
    assert q.get()[0] == "b"


def test_a_started_job_moves_its_levels_clock_and_a_late_owner_starts_from_it() -> None:
    """The level's clock is the largest tag started: an owner arriving late with a backlog has its
    tags start there, so its backlog interleaves with the waiting owner's instead of going first."""
    fair = FairShare()
    early = [fair.rank(0, "A", 1.0) for _ in range(6)]
    for rank in early[:3]:
        fair.started(rank)
    fair.started(early[0])                                  # an older tag started again: the clock stays
    late = [fair.rank(0, "B", 1.0) for _ in range(3)]
    assert [r[1] for r in late] == [4.0, 5.0, 6.0]          # from the clock (3), not from 0
    waiting = sorted([("A", r) for r in early[3:]] + [("B", r) for r in late], key=lambda w: w[1])
    assert [owner for owner, _ in waiting] == ["A", "B", "A", "B", "A", "B"]
    assert fair.rank(1, "C", 1.0)[1] == 1.0                 # another level has a clock of its own


def test_take_key_overdue_from_max_wait_s_on_and_never_when_it_is_off() -> None:
    rank = (5, 0.0, 1)
    assert take_key(rank, since=90.0, now=100.0, max_wait_s=10.0) == (0, 90.0, rank)     # waited exactly the bound
    assert take_key(rank, since=90.5, now=100.0, max_wait_s=10.0)[0] == 1
    assert take_key(rank, since=99.4, now=100.0, max_wait_s=0.5) == (0, 99.4, rank)      # a bound under a second
    assert take_key(rank, since=0.0, now=100.0, max_wait_s=0.0)[0] == 1                   # off: nothing is overdue
    # off, the queue is by rank alone, however long each waited
    now = time.time()
    waiting = [("young-urgent", (-1, 0.0, 2), now), ("old-lax", (3, 0.0, 1), now - 500)]
    assert positions(waiting, now, 0.0) == ["young-urgent", "old-lax"]
    q = ranked(max_wait_s=0.0)
    for name, rank_, since in reversed(waiting):
        q.put((name, rank_, since))
    assert [i[0] for i in q.snapshot()] == ["young-urgent", "old-lax"] and q.get()[0] == "young-urgent"


def test_snapshot_is_the_order_get_takes() -> None:
    now = time.time()
    q = ranked(maxsize=2, max_wait_s=10.0)
    items = [("b", (1, 0.0, 2), now), ("late", (9, 0.0, 3), now - 20), ("a", (0, 0.0, 4), now),
             ("c", (1, 0.0, 1), now)]
    for item in items[:2]:
        q.put(item)
    t1, t2 = q.offer(items[2]), q.offer(items[3])                 # waiting for a place: in the snapshot too
    assert [i[0] for i in q.snapshot()] == ["late", "a", "c", "b"]
    assert q.withdraw(t2) and [i[0] for i in q.snapshot()] == ["late", "a", "b"]
    assert [q.get_nowait()[0] for _ in range(3)] == ["late", "a", "b"] and q.admitted(t1, 0)
    with pytest.raises(queue.Empty):
        q.get_nowait()
    assert q.snapshot() == [] and q.qsize() == 0
