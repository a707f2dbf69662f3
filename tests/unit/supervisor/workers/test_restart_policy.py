"""Unit tests of `RestartPolicy`: crash counting, the sliding window, backoff, the load-failure retry.

Runs in the pytest process's main thread, in-process: no daemon, no event loop, no worker. Time is
a parameter (`now`), so nothing sleeps and nothing blocks.
"""

from __future__ import annotations

import pytest

from omnid import protocol as P
from omnid.supervisor.workers.restart_policy import GiveUp, Restart, RestartDecision, RestartPolicy

CRASH = -9     # killed by SIGKILL: any exit that is not EXIT_LOAD_FAILED


def policy(max_restarts: int = 3, window: float = 100.0, backoff: float = 1.0,
           backoff_max: float = 30.0) -> RestartPolicy:
    return RestartPolicy(max_restarts=max_restarts, restart_window_s=window, restart_backoff_s=backoff,
                         restart_backoff_max_s=backoff_max)


def restarts_before_giving_up(p: RestartPolicy, now: float = 0.0, step: float = 1.0) -> tuple[int, RestartDecision]:
    n = 0
    while True:
        d = p.on_exit(now + n * step, CRASH)
        if isinstance(d, GiveUp):
            return n, d
        n += 1
        assert n < 1000


@pytest.mark.parametrize("max_restarts", [0, 1, 2, 5])
def test_max_restarts_n_means_n_restarts_and_the_next_crash_gives_up(max_restarts: int) -> None:
    n, decision = restarts_before_giving_up(policy(max_restarts=max_restarts))
    assert n == max_restarts
    assert isinstance(decision, GiveUp)
    assert decision.reason == f"crashed {max_restarts + 1} times in 100 s; not restarting"


def test_crashes_older_than_the_window_are_forgotten() -> None:
    p = policy(max_restarts=2, window=10.0)
    assert isinstance(p.on_exit(0.0, CRASH), Restart)
    assert isinstance(p.on_exit(5.0, CRASH), Restart)
    # The crash at 0 is 10.5 s old: out of the window, so this is the second crash in it, not the third.
    d = p.on_exit(10.5, CRASH)
    assert isinstance(d, Restart) and d.crashes == 2
    assert isinstance(p.on_exit(14.0, CRASH), GiveUp)      # 5, 10.5, 14: three in 10 s


def test_a_crash_exactly_at_the_window_edge_still_counts() -> None:
    p = policy(max_restarts=1, window=10.0)
    assert isinstance(p.on_exit(0.0, CRASH), Restart)
    assert isinstance(p.on_exit(10.0, CRASH), GiveUp)      # now - t > window prunes; == does not


def test_spaced_out_crashes_are_restarted_for_ever() -> None:
    p = policy(max_restarts=1, window=10.0)
    for i in range(50):
        d = p.on_exit(i * 11.0, CRASH)
        assert isinstance(d, Restart) and d.crashes == 1 and d.delay_s == 1.0


def test_backoff_doubles_up_to_its_cap() -> None:
    p = policy(max_restarts=10, backoff=0.5, backoff_max=5.0)
    delays = []
    for i in range(8):
        d = p.on_exit(float(i), CRASH)
        assert isinstance(d, Restart)
        delays.append(d.delay_s)
    assert delays == [0.5, 1.0, 2.0, 4.0, 5.0, 5.0, 5.0, 5.0]


def test_a_kill_for_a_cancel_grace_is_not_a_crash() -> None:
    p = policy(max_restarts=1)
    assert isinstance(p.on_exit(0.0, CRASH), Restart)       # one crash: the last one allowed
    for i in range(5):                                      # killed on purpose, again and again
        p.note_kill(counts=False)
        d = p.on_exit(1.0 + i, -9)
        assert isinstance(d, Restart) and d.crashes == 1
    # Only the next exit was forgiven: a real crash after that gives up.
    assert isinstance(p.on_exit(10.0, CRASH), GiveUp)


def test_a_counted_kill_after_a_forgiven_one_counts() -> None:
    p = policy(max_restarts=0)
    p.note_kill(counts=False)
    p.note_kill(counts=True)                                # the later order wins (a hang after a cancel)
    assert isinstance(p.on_exit(0.0, -9), GiveUp)


def test_a_forgiven_kill_with_no_crash_in_the_window_waits_half_the_backoff() -> None:
    # Today's arithmetic, kept: 2 ** (0 - 1) with no crash counted.
    p = policy(backoff=1.0)
    p.note_kill(counts=False)
    d = p.on_exit(0.0, -9)
    assert isinstance(d, Restart) and d.crashes == 0 and d.delay_s == 0.5


def test_a_load_failure_gets_exactly_one_more_try() -> None:
    p = policy(max_restarts=5)
    d = p.on_exit(0.0, P.EXIT_LOAD_FAILED)
    assert isinstance(d, Restart)
    d = p.on_exit(1.0, P.EXIT_LOAD_FAILED)
    assert d == GiveUp("not restarting: loading fails")


def test_ready_resets_the_load_failure_retry() -> None:
    p = policy(max_restarts=5)
    assert isinstance(p.on_exit(0.0, P.EXIT_LOAD_FAILED), Restart)
    p.on_ready()
    assert isinstance(p.on_exit(1.0, P.EXIT_LOAD_FAILED), Restart)
    assert isinstance(p.on_exit(2.0, P.EXIT_LOAD_FAILED), GiveUp)


def test_other_crashes_between_load_failures_do_not_reset_the_retry() -> None:
    p = policy(max_restarts=5)
    assert isinstance(p.on_exit(0.0, P.EXIT_LOAD_FAILED), Restart)
    assert isinstance(p.on_exit(1.0, CRASH), Restart)
    assert isinstance(p.on_exit(2.0, P.EXIT_LOAD_FAILED), GiveUp)


def test_load_failures_count_as_crashes_too() -> None:
    p = policy(max_restarts=0)
    d = p.on_exit(0.0, P.EXIT_LOAD_FAILED)
    assert isinstance(d, GiveUp) and "crashed 1 times" in d.reason


def test_a_failed_spawn_counts_as_a_crash() -> None:
    p = policy(max_restarts=1)
    assert isinstance(p.on_exit(0.0, None), Restart)
    assert isinstance(p.on_exit(1.0, None), GiveUp)
