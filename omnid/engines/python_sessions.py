"""Python stages that step many jobs together: a stage's `sessions = "package.module:Class"`.

Runs in a stage worker's main thread, driven by `PythonEngine` (add, step, abort); blocks only in
the user's own `open` and `step`.

An autoregressive model that is not vLLM (a TTS talker, a vocoder decoding blocks) runs best as
vLLM runs an LLM: every live request advanced by one batched forward per step, requests joining and
leaving between steps (continuous batching). The class gives that to any python stage:

    class Sessions:
        def __init__(self, load: LoadContext) -> None: ...   # once, as the stage starts (its weights)
        def open(self, inputs: dict, params: dict, ctx) -> Any: ...   # a job's session
        def step(self, sessions: list[Any]) -> list[Any]: ...         # advance each once, one batch
        def close(self, session: Any) -> None: ...           # optional: the session is over, free its slot
        def ready(self, session: Any) -> bool: ...           # optional: it can be stepped now

- `open` is called as the job enters the stage (its prefill, say); an exception fails that job.
  `params` are the stage's `defaults` merged with the job's.
- `step` gets every live session that is ready, least slack first, and returns one result per
  session, in the same order. Slack: a stream's listener clock, `ctx.deadline` (when the audio its
  pipeline sent so far runs out at its listener, `time.time()`; the supervisor sends it with each
  audio packet), and a session with no audio out yet is due since it opened; for jobs that are not
  streams that is the order they opened. A class that cannot step all of them at once (a batch bound
  of its own, or windows that batch only when they match) steps the first ones and returns None for
  the others: that is the hook that makes a stage serve the listeners about to run dry first.
  Results: `None` (nothing this step), a dict (a segment: the job's outputs are
  its segments merged, as a generator's), `Done()` or `Done(last_segment)` (the session is over), or
  an `Exception` instance (that job fails, the others go on). A `step` that raises fails every
  session it was given.
- `ready` (default): the session's streamed inputs (`window = N` edges) have a window or their end
  to read, or it has none; a session whose downstream has no room (backpressure) is never stepped.
  A class whose sessions keep work of their own between windows says so with its own `ready`.
- Paced to the listener: a session of a stream whose listener holds more than `pace_ahead_s` seconds
  of audio (a parameter, default 3; 0: never paced) is not stepped until that falls below it:
  a stage far ahead of its listeners leaves the host's cores to the stages that are not (on a CPU
  host every stage shares them), and a stream never holds more than that in flight.
- Yielding to the stream about to run dry: while a live session is close to a gap (its listener
  holds less than half its `yield_ahead_s`, default 1; or it has sent no audio yet and opened less
  than 2 s ago: a starting stream), the sessions whose listeners hold more than `yield_ahead_s` sit
  the steps out (0: never), whether that session can be stepped now or waits for its input (the
  stage before this one, which makes it, needs the cores too). A step's cost grows with its rows on
  a CPU and the stages share the cores, so the starting stream's first packets come about as fast
  as alone's, and the streams that yield never run dry for it.
- `max_inflight` bounds the live sessions. A cancel takes effect at the next step boundary: the
  session is closed and never stepped again, and the others' results are untouched.
- `lazy = true`: the class is made on the first job instead of at start.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from omnid.engines.base import Cancelled, InputStream, RequestContext

DEFAULT_PACE_AHEAD_S = 3.0  # a stream this far ahead of its listener waits (the parameter `pace_ahead_s`)
DEFAULT_YIELD_AHEAD_S = 1.0  # ... and this far ahead, it yields a step to a stream about to run dry (`yield_ahead_s`)
STARTING_S = 2.0            # a session with no audio out yet counts as about to run dry this long after it opened


@dataclass(frozen=True)
class Done:
    """A session's result that ends it; `last`: its last segment, if it has one."""

    last: dict[str, Any] | None = None


@dataclass
class _Live:
    """One job's open session and the outputs merged so far."""

    ctx: RequestContext
    session: Any
    outputs: dict[str, Any] = field(default_factory=dict)
    opened: float = field(default_factory=time.time)
    pace_ahead_s: float = DEFAULT_PACE_AHEAD_S
    yield_ahead_s: float = DEFAULT_YIELD_AHEAD_S

    def slack(self, now: float) -> float | None:
        """The audio its listener still holds (seconds; None before its first audio)."""
        return None if self.ctx.deadline is None else self.ctx.deadline - now

    @property
    def due(self) -> float:
        """When its listener runs out of audio (`ctx.deadline`, the supervisor's listener clock); a
        session that has sent none yet is due since it opened (its first packet is awaited)."""
        return self.ctx.deadline if self.ctx.deadline is not None else self.opened


def _yielded(batch: list[_Live], live: Iterable[_Live]) -> list[_Live]:
    """The batch less the streams far ahead (`yield_ahead_s`) when a live session, in the batch or
    not, is about to run dry (its listener holds less than half its own `yield_ahead_s`, or it has
    sent no audio yet and opened less than STARTING_S ago): on a CPU host a step's cost grows with its
    rows and every stage shares the cores, so the stream starting or near a gap gets them, and so
    does the stage before this one while that stream waits for its input (a code2wav stepped the
    streams seconds ahead, 70-80 ms a step, while the codec LM's codes for one at 0 s of slack were
    late: a gap). A stream yields only while it is ahead by more than that: it never runs dry for it."""
    now = time.time()

    def urgent(session: _Live) -> bool:
        s = session.slack(now)
        return now - session.opened < STARTING_S if s is None else s < session.yield_ahead_s / 2

    if not any(urgent(session) for session in live):
        return batch
    return [session for session in batch if (s := session.slack(now)) is None or s <= session.yield_ahead_s]


def streams_ready(ctx: RequestContext) -> bool:
    """Any of the job's streamed inputs has something to read (or it has none)."""
    streams = [v for v in ctx.inputs.values() if isinstance(v, InputStream)]
    return not streams or any(v.ready() for v in streams)


class SessionRunner:
    """The live sessions of one stage and the calls into its class (`PythonEngine` owns one)."""

    def __init__(self, factory: Callable[[], Any], name: str, merge: Callable[[dict[str, Any], dict[str, Any]], None],
                 describe: Callable[[BaseException], str], lazy: bool) -> None:
        self._factory = factory
        self._impl: Any = None if lazy else factory()
        self.name = name
        self._merge = merge
        self._describe = describe
        self._live: dict[str, _Live] = {}         # job -> its session, in the order they opened

    @property
    def impl(self) -> Any:
        if self._impl is None:
            self._impl = self._factory()
        return self._impl

    def open(self, ctx: RequestContext, params: Mapping[str, Any]) -> None:
        ahead: dict[str, float] = {}            # pace_ahead_s and yield_ahead_s (0 or less: never)
        for key, default in (("pace_ahead_s", DEFAULT_PACE_AHEAD_S), ("yield_ahead_s", DEFAULT_YIELD_AHEAD_S)):
            try:
                value = float(params.get(key, default))
            except (TypeError, ValueError):
                ctx.fail(f"{key} must be a number of seconds, not {params.get(key)!r}")
                return
            ahead[key] = value if value > 0 else float("inf")
        try:
            session = self.impl.open(ctx.inputs, params, ctx)
        except Cancelled:
            ctx.stopped()
            return
        except Exception as e:
            ctx.fail(self._describe(e))
            return
        if ctx.cancelled():
            self._close(session)
            ctx.stopped()
            return
        self._live[ctx.job] = _Live(ctx, session, pace_ahead_s=ahead["pace_ahead_s"], yield_ahead_s=ahead["yield_ahead_s"])

    def _ready(self, live: _Live) -> bool:
        if live.ctx.held():
            return False
        if (slack := live.slack(time.time())) is not None and slack > live.pace_ahead_s:
            return False                        # paced: far enough ahead of its listener (others need the host)
        check = getattr(self.impl, "ready", None)
        return bool(check(live.session)) if check is not None else streams_ready(live.ctx)

    def step(self) -> None:
        """One step: the cancelled sessions closed, the ready ones advanced together."""
        for job, live in list(self._live.items()):
            if live.ctx.cancelled():
                self._end(job).ctx.stopped()
        batch = self._batch()
        if not batch:
            return
        try:
            results = self.impl.step([live.session for live in batch])
        except Exception as e:                  # Cancelled included: it ends only the cancelled ones
            for live in batch:
                self._end(live.ctx.job)
                if live.ctx.cancelled():
                    live.ctx.stopped()
                else:
                    live.ctx.fail(self._describe(e))
            return
        if not isinstance(results, (list, tuple)) or len(results) != len(batch):
            got = f"{len(results)} results" if isinstance(results, (list, tuple)) else type(results).__name__
            for live in batch:
                self._end(live.ctx.job).ctx.fail(f"sessions {self.name}.step returned {got} for {len(batch)} "
                                                 "sessions; it must return one result per session, in order")
            return
        for live, result in zip(batch, results):
            self._take(live, result)

    def _take(self, live: _Live, result: Any) -> None:
        ctx = live.ctx
        if ctx.cancelled():
            self._end(ctx.job).ctx.stopped()
        elif result is None:
            return
        elif isinstance(result, Done):
            if result.last is not None and not self._segment(live, result.last):
                return
            self._end(ctx.job)
            ctx.segment({}, is_last=True)
            ctx.finish(live.outputs)
        elif isinstance(result, BaseException):
            self._end(ctx.job).ctx.fail(self._describe(result))
        else:
            self._segment(live, result)

    def _segment(self, live: _Live, seg: Any) -> bool:
        if not isinstance(seg, dict):
            self._end(live.ctx.job).ctx.fail(f"sessions {self.name}.step gave {type(seg).__name__} for a session, "
                                             "not a dict of named outputs, None, Done or an Exception")
            return False
        self._merge(live.outputs, seg)
        live.ctx.segment(seg)
        if live.ctx.done:                       # the segment failed it (a stream could not take it)
            self._end(live.ctx.job)
            return False
        return True

    def _end(self, job: str) -> _Live:
        live = self._live.pop(job)
        self._close(live.session)
        return live

    def _close(self, session: Any) -> None:
        close = getattr(self.impl, "close", None)
        if close is not None:
            try:
                close(session)
            except Exception:
                pass                            # (its job has its outcome already)

    def abort(self, job: str) -> None:
        if job in self._live:
            self._end(job).ctx.stopped()

    def has_work(self) -> bool:
        return bool(self._live)

    def ready(self) -> bool:
        """A step now would step a session (none ready, or only ones that yield: the worker waits
        for an input or its next look)."""
        return bool(self._batch())

    def _batch(self) -> list[_Live]:
        """The sessions the next step takes: the ready ones, least slack first (the session whose
        listener runs dry soonest leads), less the ones that yield (`_yielded`)."""
        ready = sorted((live for live in self._live.values() if self._ready(live)), key=lambda live: live.due)
        return _yielded(ready, self._live.values()) if ready else ready

    def __len__(self) -> int:
        return len(self._live)
