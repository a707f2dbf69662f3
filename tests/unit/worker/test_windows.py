"""`omnid.worker.windows`: windows of an upstream's segments (`stitch`, `WindowBuilder`) and the
streams a downstream reads them from (`EdgeStream`, and `omnid.engines.base.InputStream` over it), in-process.

The module is used as `W.<name>` throughout, so a modified copy can stand in for it
(`sys.modules["omnid.worker.windows"]`) when checking that these tests catch a change.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import numpy as np
import pytest

from omnid.engines.base import Cancelled, InputStream
from omnid.worker import windows as W

PROMPT_S = 0.25      # "at once": far below this (a cancel wakes the waiter; a polled one within 50 ms)


# ------------------------------------------------------------------ stitch


def test_stitch_concatenates_text_and_bytes() -> None:
    assert W.stitch([{"t": "ab"}, {"t": "c"}, {"t": ""}, {"t": "d"}]) == {"t": "abcd"}
    out = W.stitch([{"b": b"\x00\x01"}, {"b": bytearray(b"\x02")}, {"b": b"\x03"}])
    assert out == {"b": b"\x00\x01\x02\x03"} and type(out["b"]) is bytes


def test_stitch_extends_lists() -> None:
    assert W.stitch([{"l": [1]}, {"l": [2, 3]}, {"l": []}, {"l": [4]}]) == {"l": [1, 2, 3, 4]}


def test_stitch_concatenates_arrays_on_axis_0() -> None:
    a, b = np.arange(6).reshape(2, 3), np.arange(6, 9).reshape(1, 3)
    out = W.stitch([{"x": a}, {"x": b}])["x"]
    assert out.shape == (3, 3)
    assert (out == np.arange(9).reshape(3, 3)).all()
    one_d = W.stitch([{"x": np.array([1.0, 2.0])}, {"x": np.array([3.0])}])["x"]
    assert one_d.tolist() == [1.0, 2.0, 3.0]


def test_stitch_keeps_the_latest_of_anything_else() -> None:
    # Numbers, dicts, 0-d arrays, and values whose types differ from one segment to the next.
    assert W.stitch([{"n": 1}, {"n": 2}]) == {"n": 2}
    assert W.stitch([{"d": {"a": 1}}, {"d": {"b": 2}}]) == {"d": {"b": 2}}
    assert W.stitch([{"s": np.float32(1.5)}, {"s": np.float32(2.5)}])["s"] == np.float32(2.5)
    assert W.stitch([{"z": np.array(1)}, {"z": np.array(2)}])["z"] == 2
    assert W.stitch([{"m": "text"}, {"m": b"bytes"}]) == {"m": b"bytes"}
    assert W.stitch([{"m": [1]}, {"m": "x"}]) == {"m": "x"}


def test_stitch_keeps_every_key_in_order_of_first_appearance() -> None:
    out = W.stitch([{"a": "1"}, {"b": [1]}, {"a": "2", "c": 3}, {"b": [2]}])
    assert out == {"a": "12", "b": [1, 2], "c": 3} and list(out) == ["a", "b", "c"]
    assert W.stitch([]) == {}
    assert W.stitch([{}, {}]) == {}


def test_stitch_does_not_change_its_segments() -> None:
    segments: list[dict[str, Any]] = [{"l": [1]}, {"l": [2]}]
    W.stitch(segments)
    assert segments == [{"l": [1]}, {"l": [2]}]


def test_stitch_concatenates_torch_tensors_on_dim_0() -> None:
    torch = pytest.importorskip("torch")
    out = W.stitch([{"x": torch.zeros(2, 4)}, {"x": torch.ones(3, 4)}])["x"]
    assert tuple(out.shape) == (5, 4) and out[:2].sum().item() == 0 and out[2:].sum().item() == 12
    assert W.stitch([{"s": torch.tensor(1)}, {"s": torch.tensor(2)}])["s"].item() == 2    # 0-d: the latest


# ------------------------------------------------------------------ WindowBuilder


def test_builder_emits_every_n_segments_and_a_shorter_last_one() -> None:
    b = W.WindowBuilder(3)
    got = [b.add({"t": c}, is_last=False) for c in "abcdefg"]
    assert got == [None, None, (0, {"t": "abc"}), None, None, (1, {"t": "def"}), None]
    assert b.sent == 2 and not b.closed
    assert b.add({"t": "h"}, is_last=True) == (2, {"t": "gh"})     # the last window is shorter
    assert b.closed and b.sent == 3


def test_builder_of_one_emits_each_segment() -> None:
    b = W.WindowBuilder(1)
    assert b.add({"t": "a"}, False) == (0, {"t": "a"})
    assert b.add({"t": "b"}, False) == (1, {"t": "b"})
    assert b.add({"t": "c"}, True) == (2, {"t": "c"}) and b.closed


def test_builder_ignores_empty_segments() -> None:
    b = W.WindowBuilder(2)
    assert b.add({}, False) is None
    assert b.add({"t": "a"}, False) is None
    assert b.add({}, False) is None
    assert b.add({"t": "b"}, False) == (0, {"t": "ab"})


def test_builder_last_window_is_empty_after_an_exact_multiple() -> None:
    b = W.WindowBuilder(2)
    assert [b.add({"t": c}, False) for c in "abcd"] == [None, (0, {"t": "ab"}), None, (1, {"t": "cd"})]
    # The request completes: its whole outputs are not sent again; an empty last window says "done".
    assert b.finish({"t": "abcd"}) == (2, {})
    assert b.closed
    # The same through a last segment that holds nothing.
    b = W.WindowBuilder(2)
    b.add({"t": "a"}, False)
    b.add({"t": "b"}, False)
    assert b.add({}, is_last=True) == (1, {})


def test_builder_finish_sends_what_is_pending_not_the_whole_outputs() -> None:
    b = W.WindowBuilder(3)
    assert b.add({"t": "a"}, False) is None
    assert b.finish({"t": "a", "extra": 1}) == (0, {"t": "a"})
    assert b.closed


def test_builder_finish_with_nothing_streamed_sends_the_whole_outputs() -> None:
    b = W.WindowBuilder(4)
    outputs = {"text": "all of it", "n": 3}
    assert b.finish(outputs) == (0, outputs)
    assert b.closed and b.sent == 1
    # Also when the engine's segments held nothing at all.
    b = W.WindowBuilder(2)
    assert b.add({}, False) is None
    assert b.finish({"text": "x"}) == (0, {"text": "x"})


def test_builder_sends_nothing_after_it_closed() -> None:
    b = W.WindowBuilder(2)
    assert b.add({"t": "a"}, is_last=True) == (0, {"t": "a"})
    assert b.add({"t": "b"}, False) is None
    assert b.add({"t": "c"}, True) is None
    assert b.finish({"t": "abc"}) is None
    assert b.sent == 1
    b = W.WindowBuilder(2)
    assert b.finish({"t": "x"}) == (0, {"t": "x"})
    assert b.finish({"t": "x"}) is None
    assert b.add({"t": "y"}, True) is None


# ------------------------------------------------------------------ EdgeStream / InputStream


def stream(keys: tuple[str, ...] = ("x",), capacity: int = 8,
           is_cancelled: Any = None) -> W.EdgeStream:
    return W.EdgeStream(list(keys), capacity, is_cancelled or (lambda: False))


class Reader(threading.Thread):
    """Iterates an InputStream in its own thread; records what it got, how it ended and when."""

    def __init__(self, inp: InputStream) -> None:
        super().__init__(daemon=True)
        self.inp = inp
        self.got: list[Any] = []
        self.error: BaseException | None = None
        self.ended_at: float | None = None

    def run(self) -> None:
        try:
            for value in self.inp:
                self.got.append(value)
        except BaseException as e:
            self.error = e
        self.ended_at = time.monotonic()


def test_iteration_yields_each_window_and_ends_after_the_last() -> None:
    s = stream()
    assert s.put(0, {"x": "a"}, last=False) is True
    assert s.put(1, {"x": "b"}, last=False) is True
    assert s.put(2, {"x": "c"}, last=True) is True
    assert list(InputStream(s, "x")) == ["a", "b", "c"]
    assert s.ended and s.next_index == 3


def test_iteration_ends_on_an_empty_last_window() -> None:
    s = stream()
    s.put(0, {"x": "a"}, last=False)
    s.put(1, {}, last=True)
    assert list(InputStream(s, "x")) == ["a"]


def test_iteration_blocks_until_windows_come_from_another_thread() -> None:
    s = stream()
    inp = InputStream(s, "x")
    reader = Reader(inp)
    reader.start()
    time.sleep(0.1)
    assert reader.is_alive() and reader.got == []          # nothing yet: it waits
    for i in range(5):
        assert s.put(i, {"x": i}, last=False) is True
        time.sleep(0.02)
    time.sleep(0.05)
    assert reader.is_alive() and reader.got == [0, 1, 2, 3, 4]
    s.put(5, {"x": 5}, last=True)
    reader.join(2)
    assert not reader.is_alive() and reader.error is None
    assert reader.got == [0, 1, 2, 3, 4, 5]


def test_each_input_gets_its_own_values() -> None:
    s = stream(keys=("a", "b"))
    s.put(0, {"a": 1, "b": "x"}, last=False)
    s.put(1, {"a": 2}, last=True)                 # a window without "b": nothing for b
    assert list(InputStream(s, "b")) == ["x"]
    assert list(InputStream(s, "a")) == [1, 2]


def test_cancel_from_another_thread_raises_cancelled_at_once() -> None:
    s = stream()
    reader = Reader(InputStream(s, "x"))
    reader.start()
    time.sleep(0.1)
    assert reader.is_alive()
    cancelled_at = time.monotonic()
    s.cancel()
    reader.join(2)
    assert isinstance(reader.error, Cancelled), reader.error
    assert reader.ended_at is not None and reader.ended_at - cancelled_at < PROMPT_S


def test_is_cancelled_turning_true_raises_cancelled_promptly() -> None:
    flag = threading.Event()
    s = stream(is_cancelled=flag.is_set)
    reader = Reader(InputStream(s, "x"))
    reader.start()
    time.sleep(0.1)
    assert reader.is_alive()
    cancelled_at = time.monotonic()
    flag.set()                                    # no notify: the waiter looks again on its own
    reader.join(2)
    assert isinstance(reader.error, Cancelled), reader.error
    assert reader.ended_at is not None and reader.ended_at - cancelled_at < PROMPT_S


def test_a_cancelled_stream_raises_even_with_windows_waiting() -> None:
    s = stream()
    s.put(0, {"x": "a"}, last=False)
    s.cancel()
    with pytest.raises(Cancelled):
        next(InputStream(s, "x"))
    s = stream(is_cancelled=lambda: True)
    s.put(0, {"x": "a"}, last=True)
    with pytest.raises(Cancelled):
        next(InputStream(s, "x"))


def test_put_answers_none_when_full_and_takes_it_once_there_is_room() -> None:
    s = stream(capacity=2)
    assert s.put(0, {"x": 0}, last=False) is True
    assert s.put(1, {"x": 1}, last=False) is True
    assert s.put(2, {"x": 2}, last=False) is None          # full: offered again later
    assert s.next_index == 2 and s.pending() == 2
    inp = InputStream(s, "x")
    assert next(inp) == 0
    assert s.put(2, {"x": 2}, last=False) is True
    assert s.put(3, {"x": 3}, last=True) is None            # full again, even for the last window
    assert not s.ended
    # An empty last window takes no room: it is taken even when full.
    assert s.put(3, {}, last=True) is True and s.ended
    assert list(inp) == [1, 2]


def test_capacity_is_at_least_one() -> None:
    s = stream(capacity=0)
    assert s.put(0, {"x": 0}, last=False) is True
    assert s.put(1, {"x": 1}, last=False) is None


def test_a_resent_window_is_taken_once() -> None:
    s = stream()
    assert s.put(0, {"x": "a"}, last=False) is True
    assert s.put(0, {"x": "a"}, last=False) is True         # idempotent: already held
    assert s.put(1, {"x": "b"}, last=True) is True
    assert s.put(1, {"x": "b"}, last=True) is True
    assert s.put(0, {"x": "a"}, last=False) is True
    assert list(InputStream(s, "x")) == ["a", "b"]


def test_out_of_order_and_after_the_end_are_refused() -> None:
    s = stream()
    assert s.put(1, {"x": "b"}, last=False) is None
    assert s.next_index == 0 and s.pending() == 0
    assert s.put(0, {"x": "a"}, last=True) is True
    assert s.put(1, {"x": "b"}, last=False) is None         # after the last window: nothing more
    assert list(InputStream(s, "x")) == ["a"]


def test_ready_says_whether_next_would_block() -> None:
    flag = threading.Event()
    s = stream(is_cancelled=flag.is_set)
    inp = InputStream(s, "x")
    assert not inp.ready()
    s.put(0, {"x": "a"}, last=False)
    assert inp.ready()
    assert next(inp) == "a"
    assert not inp.ready()
    s.put(1, {}, last=True)
    assert inp.ready()                                      # ended: next() returns at once
    with pytest.raises(StopIteration):
        next(inp)

    s = stream()
    s.cancel()
    assert InputStream(s, "x").ready()
    s = stream(is_cancelled=flag.is_set)
    assert not InputStream(s, "x").ready()
    flag.set()
    assert InputStream(s, "x").ready()


def test_ready_is_per_input() -> None:
    s = stream(keys=("a", "b"))
    s.put(0, {"a": 1}, last=False)
    assert InputStream(s, "a").ready() and not InputStream(s, "b").ready()


def test_input_stream_is_its_own_iterator_and_says_where_it_is() -> None:
    s = stream()
    inp = InputStream(s, "x")
    assert iter(inp) is inp and inp.key == "x"
    s.put(0, {"x": 1}, last=False)
    assert repr(inp) == "<InputStream 'x': window 1 next>"


def _median_wake_s(wake: Any, trials: int = 9) -> float:
    """How long a reader blocked in next() takes to return after `wake(stream, i)`, the median of
    `trials`. A waiter is notified at once; one left to its 50 ms re-check takes 25 ms on average."""
    delays = []
    for i in range(trials):
        s = stream()
        reader = Reader(InputStream(s, "x"))
        reader.start()
        time.sleep(0.02 + 0.007 * i)              # catch the reader's re-check at different phases
        woken_at = time.monotonic()
        wake(s, i)
        reader.join(2)
        assert reader.ended_at is not None
        delays.append(reader.ended_at - woken_at)
    return sorted(delays)[trials // 2]


def test_a_window_or_a_cancel_wakes_the_reader_without_waiting_for_its_recheck() -> None:
    assert _median_wake_s(lambda s, i: s.put(0, {"x": i}, last=True)) < 0.012
    assert _median_wake_s(lambda s, i: s.cancel()) < 0.012


# ------------------------------------------------------------------ window schedules


def _sizes(builder: W.WindowBuilder, segments: int) -> list[tuple[int, int, bool]]:
    """(index, segments in it, last) of each window `segments` one-item segments make."""
    out = []
    for i in range(segments):
        window = builder.add({"l": [i]}, is_last=i == segments - 1)
        if window is not None:
            out.append((window[0], len(window[1]["l"]), builder.closed))
    return out


def test_a_schedule_gives_its_sizes_then_repeats_the_last() -> None:
    got = _sizes(W.WindowBuilder([4, 8, 16, 25]), 4 + 8 + 16 + 25 + 25 + 7)
    assert got == [(0, 4, False), (1, 8, False), (2, 16, False), (3, 25, False), (4, 25, False), (5, 7, True)]


def test_a_schedule_keeps_segments_in_order_and_ends_early() -> None:
    b = W.WindowBuilder((2, 3))
    values = [b.add({"l": [i]}, is_last=False) for i in range(5)]
    assert [v[1]["l"] if v else None for v in values] == [None, [0, 1], None, None, [2, 3, 4]]
    assert b.finish({}) == (2, {})                  # an exact end: an empty last window
    short = W.WindowBuilder([4, 8])
    assert [short.add({"l": [i]}, is_last=i == 2) for i in range(3)][-1] == (0, {"l": [0, 1, 2]})


def test_n_is_a_schedule_of_one() -> None:
    assert _sizes(W.WindowBuilder(3), 7) == _sizes(W.WindowBuilder([3]), 7) == [(0, 3, False), (1, 3, False),
                                                                                (2, 1, True)]


@pytest.mark.parametrize("sizes", [[], [4, 0], 0, [-1]])
def test_a_schedule_of_nothing_is_refused(sizes: Any) -> None:
    with pytest.raises(ValueError):
        W.WindowBuilder(sizes)
