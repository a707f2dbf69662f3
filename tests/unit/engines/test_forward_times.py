"""The step loop's measured times (omnid.engines.diffusers_loop.ForwardTimes), and the rule that
reads them (DiffusersEngine._gives_way_until): when a forward gives way to a job that arrives during
it. (The give-way itself, with a real daemon and model: tests/test_diffusers_joining.py.)"""

from __future__ import annotations

from typing import Any

import pytest

from omnid.engines.diffusers_loop import ForwardTimes


def test_a_sizes_first_forward_only_warms_its_kernels() -> None:
    times = ForwardTimes()
    times.ran("64x64", 3, 0.500)            # a new batch size builds its kernels
    assert times.took("64x64", 3) is None
    times.ran("64x64", 3, 0.100)
    assert times.took("64x64", 3) == pytest.approx(0.100)
    times.ran("64x64", 3, 0.200)            # a running mean, a quarter of the news
    assert times.took("64x64", 3) == pytest.approx(0.125)


def test_the_join_time_is_a_rows_prepare_and_one_rows_forward_of_its_shape() -> None:
    times = ForwardTimes()
    times.prepared("64x64", 0.005)
    assert times.join_time("64x64") is None          # one row's forward not timed yet
    times.ran("64x64", 1, 0.040)
    times.ran("64x64", 1, 0.030)
    assert times.join_time("64x64") == pytest.approx(0.035)
    assert times.join_time("32x32") is None          # shapes are timed apart
    times.ran("32x32", 1, 0.010)
    times.ran("32x32", 1, 0.010)
    assert times.join_time("32x32") == pytest.approx(0.010)    # (no prepare timed for it)


def test_timed_reports_milliseconds_by_shape_and_rows() -> None:
    times = ForwardTimes()
    times.prepared("64x64", 0.0048)
    for rows, seconds in ((1, 0.029), (1, 0.029), (8, 0.119), (8, 0.119)):
        times.ran("64x64", rows, seconds)
    assert times.timed() == {"64x64": {"prepare": 4.8, "1": 29.0, "8": 119.0}}


class _Row:
    def __init__(self, key: str = "64x64", gave_way: bool = False) -> None:
        self.key, self.gave_way = key, gave_way


def _engine(rows: int, max_batch: int = 8) -> Any:
    """A DiffusersEngine's give-way state, without a model: the times of a lone row (30 ms forward,
    5 ms prepare) and of 4 rows (120 ms)."""
    from omnid.engines.diffusers_engine import DiffusersEngine

    engine = DiffusersEngine.__new__(DiffusersEngine)
    times = ForwardTimes()
    for n, seconds in ((1, 0.030), (1, 0.030), (4, 0.120), (4, 0.120)):
        times.ran("64x64", n, seconds)
    times.prepared("64x64", 0.005)
    engine._times, engine._queue, engine._pending, engine.max_batch = times, [], None, max_batch
    engine._rows = [_Row() for _ in range(rows)]
    return engine


def test_a_forward_gives_way_while_more_is_left_than_a_newcomers_way_to_its_first_step() -> None:
    engine = _engine(4)
    assert engine._gives_way_until(engine._rows, 100.0) == pytest.approx(100.0 + 0.120 - 0.035)
    lone = _engine(1)
    assert lone._gives_way_until(lone._rows, 100.0) is None      # a row's forward: shorter than the way


def test_a_forward_does_not_give_way_when_no_job_could_join_or_a_row_gave_way_already() -> None:
    full = _engine(4, max_batch=4)
    assert full._gives_way_until(full._rows, 100.0) is None      # every place taken
    queued = _engine(4)
    queued._queue = ["a job that cannot join"]
    assert queued._gives_way_until(queued._rows, 100.0) is None
    waiting = _engine(4)
    waiting._pending = {"style": "/adapters/style"}               # an adapter set waits for the drain
    assert waiting._gives_way_until(waiting._rows, 100.0) is None
    again = _engine(4)
    again._rows[2].gave_way = True          # its forward gave way once: this one runs, so it moves
    assert again._gives_way_until(again._rows, 100.0) is None
    untimed = _engine(3)
    assert untimed._gives_way_until(untimed._rows, 100.0) is None   # 3 rows never timed
