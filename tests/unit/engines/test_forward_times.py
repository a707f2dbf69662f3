"""The step loop's measured times (omnid.engines.diffusers_loop.ForwardTimes), which say when a
forward gives way to a job that arrives during it."""

from __future__ import annotations

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
