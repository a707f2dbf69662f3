"""`PythonEngine` with `sessions` (omnid.engines.python_sessions), in-process: real RequestContexts
and real window streams, no worker, no daemon. Driven as the worker drives it: `add`, then `step`.
"""

from __future__ import annotations

from typing import Any

import pytest
from conftest import FIXTURES

from omnid import config as C
from omnid.config import StageConfig
from omnid.engines.base import InputStream, Outcome, RequestContext
from omnid.engines.python_engine import PythonEngine
from omnid.engines.python_sessions import Done
from omnid.worker.windows import EdgeStream


def stage(max_inflight: int = 8, lazy: bool = False, defaults: dict[str, Any] | None = None) -> StageConfig:
    return StageConfig(name="t", engine="python", sessions="sessionstages:Counter", python_path=(FIXTURES,),
                       max_inflight=max_inflight, defaults=defaults or {}, lazy=lazy)


class Job:
    def __init__(self, name: str, params: dict[str, Any] | None = None, inputs: dict[str, Any] | None = None) -> None:
        self.cancel = False
        self.segments: list[dict[str, Any]] = []
        self.ctx = RequestContext(job=name, stage="t", inputs=inputs or {}, params=params or {},
                                  _is_cancelled=lambda: self.cancel,
                                  _on_segment=lambda outputs, is_last: self.segments.append(outputs) or None)


def drive(engine: PythonEngine, limit: int = 100) -> int:
    steps = 0
    while engine.has_work():
        engine.step()
        steps += 1
        assert steps < limit
    return steps


def test_sessions_step_together_join_and_leave_between_steps() -> None:
    engine = PythonEngine(stage())
    impl = engine.sessions.impl             # type: ignore[union-attr]
    a, b = Job("a", {"n": 3}), Job("b", {"n": 1})
    engine.add(a.ctx)
    engine.add(b.ctx)
    engine.step()                           # a and b in one call; b is done after it
    c = Job("c", {"n": 2})
    engine.add(c.ctx)                       # joins between steps
    drive(engine)
    assert impl.steps == [["a", "b"], ["a", "c"], ["a", "c"]]
    for job, text in ((a, "0 1 2 "), (b, "0 "), (c, "0 1 ")):
        assert job.ctx.outcome is Outcome.FINISHED and job.ctx.outputs["text"] == text, job.ctx
    assert [s.get("batch") for s in a.segments] == [2, 2, 2, None]     # (the last: the end marker {})
    assert sorted(impl.closed) == ["a", "b", "c"]                       # every slot freed
    assert engine.info()["sessions"] == {"class": "sessionstages:Counter", "live": 0}


def test_one_sessions_exception_fails_its_job_alone() -> None:
    engine = PythonEngine(stage())
    ok, bad = Job("ok", {"n": 3}), Job("bad", {"n": 3, "fail_at": 1})
    engine.add(ok.ctx)
    engine.add(bad.ctx)
    drive(engine)
    assert ok.ctx.outcome is Outcome.FINISHED and ok.ctx.outputs["text"] == "0 1 2 "
    assert bad.ctx.outcome is Outcome.FAILED and "ValueError: bad failed at 1" in (bad.ctx.error or "")
    assert engine.sessions.impl.closed[0] == "bad"           # type: ignore[union-attr]


def test_a_step_that_raises_fails_the_sessions_it_was_given_and_an_open_that_raises_its_job() -> None:
    engine = PythonEngine(stage())
    x, y = Job("x", {"n": 3, "raise_at": 1}), Job("y", {"open_fails": True})
    engine.add(x.ctx)
    engine.add(y.ctx)
    assert y.ctx.outcome is Outcome.FAILED and "cannot open y" in (y.ctx.error or "")
    z = Job("z", {"n": 5})
    engine.add(z.ctx)
    drive(engine)
    assert x.ctx.outcome is Outcome.FAILED and "the whole step failed" in (x.ctx.error or "")
    assert z.ctx.outcome is Outcome.FAILED                  # it was in that step too
    assert sorted(engine.sessions.impl.closed) == ["x", "z"]    # type: ignore[union-attr]  # their slots freed
    after = Job("after", {"n": 1})
    engine.add(after.ctx)
    drive(engine)
    assert after.ctx.outcome is Outcome.FINISHED            # the next step runs


def test_a_cancel_takes_effect_at_the_next_step_and_the_others_are_unchanged() -> None:
    engine = PythonEngine(stage())
    impl = engine.sessions.impl             # type: ignore[union-attr]
    keep, drop = Job("keep", {"n": 4}), Job("drop", {"n": 4})
    engine.add(keep.ctx)
    engine.add(drop.ctx)
    engine.step()
    drop.cancel = True
    drive(engine)
    assert drop.ctx.outcome is Outcome.STOPPED and "drop" in impl.closed
    assert all("drop" not in step for step in impl.steps[1:])
    assert keep.ctx.outcome is Outcome.FINISHED and keep.ctx.outputs["text"] == "0 1 2 3 "
    engine.add(gone := Job("gone", {"n": 2}).ctx)
    engine.abort("gone")                    # the worker's abort: closed at once
    assert gone.outcome is Outcome.STOPPED and impl.closed[-1] == "gone" and not engine.has_work()


def test_a_session_waiting_for_its_stream_is_not_stepped() -> None:
    engine = PythonEngine(stage())
    impl = engine.sessions.impl             # type: ignore[union-attr]
    stream = EdgeStream(["wait"], 4, is_cancelled=lambda: False)
    fed, free = Job("fed", {"n": 9}, {"wait": InputStream(stream, "wait")}), Job("free", {"n": 2})
    engine.add(fed.ctx)
    engine.add(free.ctx)
    engine.step()
    assert impl.steps == [["free"]] and engine.ready()       # free runs on; fed has no window yet
    stream.put(0, {"wait": "w0"}, last=False)
    engine.step()
    assert impl.steps[-1] == ["fed", "free"]
    stream.put(1, {}, last=True)
    drive(engine)
    assert fed.ctx.outcome is Outcome.FINISHED and fed.ctx.outputs["text"] == "0 "


def test_lazy_makes_the_class_on_the_first_job_and_loaded_says_when_it_was_made() -> None:
    from sessionstages import Counter
    before = Counter.made
    eager = PythonEngine(stage())
    assert Counter.made == before + 1 and eager.loaded == ["sessionstages:Counter()"]
    lazy = PythonEngine(stage(lazy=True))
    assert Counter.made == before + 1 and lazy.loaded == []
    lazy.add(Job("j", {"n": 1}).ctx)
    assert Counter.made == before + 2


def test_check_refuses_sessions_beside_a_function_and_on_other_engines(tmp_path: Any) -> None:
    (tmp_path / "llm").mkdir()
    (tmp_path / "llm" / "config.json").write_text("{}")
    data = {"stages": {"both": {"engine": "python", "sessions": "json:JSONDecoder", "function": "json:dumps"},
                       "v": {"engine": "vllm", "model": str(tmp_path / "llm"), "sessions": "json:JSONDecoder"},
                       "alone": {"engine": "python", "sessions": "json:JSONDecoder"}},
            "pipelines": {"p": {"stages": ["alone"]}}}
    with pytest.raises(C.ConfigError) as e:
        C.parse(data, base=tmp_path)
    found = {p.path: p.message for p in e.value.problems}
    assert "takes no function nor batch_function" in found["stages.both.sessions"]
    assert found["stages.v.sessions"] == "only python stages take sessions, not 'vllm'"
    assert "stages.alone.sessions" not in found and "stages.alone.function" not in found


def test_sessions_are_stepped_least_slack_first() -> None:
    """The listener's clock (`ctx.deadline`, the supervisor's Deadline) orders a step's sessions: the
    one whose audio runs out first leads; one with no audio out yet is due since it opened. (None
    yields its step here: `yield_ahead_s` 0; that rule has a test of its own.)"""
    import time

    engine = PythonEngine(stage(defaults={"yield_ahead_s": 0}))
    impl = engine.sessions.impl             # type: ignore[union-attr]
    a, b, c = Job("a", {"n": 5}), Job("b", {"n": 5}), Job("c", {"n": 5})
    for job in (a, b, c):
        engine.add(job.ctx)
    now = time.time()
    a.ctx.deadline, b.ctx.deadline = now + 2.5, now + 1.0     # c: none yet (opened just now)
    engine.step()
    assert impl.steps[-1] == ["c", "b", "a"]
    c.ctx.deadline = now + 2.0
    engine.step()
    assert impl.steps[-1] == ["b", "c", "a"]


def test_a_session_far_ahead_of_its_listener_waits() -> None:
    """Paced: a stream whose listener holds more than `pace_ahead_s` of audio is not stepped; the
    others are; it goes on once its slack falls under that."""
    import time

    engine = PythonEngine(stage(defaults={"pace_ahead_s": 2.0}))
    impl = engine.sessions.impl             # type: ignore[union-attr]
    a, b = Job("a", {"n": 5}), Job("b", {"n": 5})
    engine.add(a.ctx)
    engine.add(b.ctx)
    a.ctx.deadline = time.time() + 10.0
    engine.step()
    assert impl.steps[-1] == ["b"]
    a.ctx.deadline = time.time() + 1.0
    engine.step()
    assert impl.steps[-1] == ["b", "a"]     # (b, with no audio out yet, is due since it opened)
    bad = Job("c", {"pace_ahead_s": "soon"})
    engine.add(bad.ctx)
    assert bad.ctx.outcome is Outcome.FAILED and "pace_ahead_s" in str(bad.ctx.error)


# ------------------------------------------------------------------ the runner with a scripted class


class Scripted:
    """A sessions class whose step returns what the test set (`answers`), and that records its calls."""

    def __init__(self) -> None:
        self.answers: Any = None
        self.closed: list[Any] = []

    def open(self, inputs: dict[str, Any], params: dict[str, Any], ctx: RequestContext) -> str:
        return ctx.job

    def step(self, sessions: list[str]) -> Any:
        return self.answers(sessions) if callable(self.answers) else self.answers

    def close(self, session: str) -> None:
        self.closed.append(session)


class Last(Job):
    def __init__(self, name: str, params: dict[str, Any] | None = None, inputs: dict[str, Any] | None = None) -> None:
        super().__init__(name, params, inputs)
        self.lasts: list[bool] = []
        self.ctx._on_segment = lambda outputs, is_last: self.segments.append(outputs) or self.lasts.append(is_last)


def runner(impl: Any) -> Any:
    from omnid.engines.python_sessions import SessionRunner
    return SessionRunner(lambda: impl, "mine:S", lambda into, seg: into.update(seg), lambda e: f"{type(e).__name__}: {e}",
                         lazy=False)


def test_wrong_results_from_step_fail_their_sessions_in_words() -> None:
    impl = Scripted()
    r = runner(impl)
    a, b = Job("a"), Job("b")
    r.open(a.ctx, {})
    r.open(b.ctx, {})
    impl.answers = [None]
    r.step()
    for job in (a, b):
        assert job.ctx.outcome is Outcome.FAILED and job.ctx.error == (
            "sessions mine:S.step returned 1 results for 2 sessions; it must return one result per session, in order")
    assert sorted(impl.closed) == ["a", "b"]
    c = Job("c")
    r.open(c.ctx, {})
    impl.answers = {"text": "x"}
    r.step()
    assert c.ctx.error == "sessions mine:S.step returned dict for 1 sessions; it must return one result per session, in order"
    d = Job("d")
    r.open(d.ctx, {})
    impl.answers = [7]
    r.step()
    assert d.ctx.error == ("sessions mine:S.step gave int for a session, not a dict of named outputs, None, Done or an "
                           "Exception") and impl.closed[-1] == "d"
    e = Job("e")
    r.open(e.ctx, {})
    impl.answers = [Done(last=3)]                        # a Done's last segment is checked too
    r.step()
    assert e.ctx.outcome is Outcome.FAILED and "gave int for a session" in (e.ctx.error or "")
    assert e.segments == []


def test_a_done_ends_with_the_end_marker_and_a_bad_pace_says_its_value() -> None:
    impl = Scripted()
    r = runner(impl)
    a = Last("a")
    r.open(a.ctx, {})
    impl.answers = [{"text": "hi"}]
    r.step()
    impl.answers = [Done({"text": "!"})]
    r.step()
    assert a.segments == [{"text": "hi"}, {"text": "!"}, {}] and a.lasts == [False, False, True]
    assert a.ctx.outcome is Outcome.FINISHED and a.ctx.outputs == {"text": "!"} and impl.closed == ["a"]
    bad = Job("bad")
    r.open(bad.ctx, {"pace_ahead_s": "soon"})
    assert bad.ctx.error == "pace_ahead_s must be a number of seconds, not 'soon'"


def test_pace_ahead_zero_or_less_never_paces_and_a_fraction_does() -> None:
    import time

    impl = Scripted()
    stepped: list[list[str]] = []
    impl.answers = lambda sessions: stepped.append(list(sessions)) or [None] * len(sessions)
    r = runner(impl)
    jobs = {p: Job(f"p{p}", {"pace_ahead_s": p}) for p in (0, -1, 0.5)}
    for job in jobs.values():
        r.open(job.ctx, job.ctx.params)
        job.ctx.deadline = time.time() + 100
    r.step()
    assert stepped == [["p0", "p-1"]]


def test_streams_ready_and_a_class_of_its_own_ready() -> None:
    from omnid.engines.python_sessions import streams_ready

    stream = EdgeStream(["w"], 4, is_cancelled=lambda: False)
    job = Job("s", inputs={"w": InputStream(stream, "w"), "plain": 1})
    assert streams_ready(Job("none", inputs={"plain": 1}).ctx) is True
    assert streams_ready(job.ctx) is False
    stream.put(0, {"w": "x"}, last=False)
    assert streams_ready(job.ctx) is True

    impl = Scripted()
    stepped: list[list[str]] = []
    impl.answers = lambda sessions: stepped.append(list(sessions)) or [None] * len(sessions)
    impl.ready = lambda session: session == "yes"        # type: ignore[attr-defined]
    r = runner(impl)
    for name in ("yes", "no"):
        r.open(Job(name).ctx, {})
    r.step()
    assert stepped == [["yes"]]


def test_a_stream_far_ahead_yields_to_one_that_waits_for_its_input() -> None:
    """A session near a gap that cannot be stepped yet (its input is not here: the stage before
    makes it, on the same cores) still makes the ones far ahead sit out; with nothing else to step,
    `ready` is False (the worker waits for an input instead of stepping the ones ahead, or spinning)."""
    import time

    impl = Scripted()
    stepped: list[list[str]] = []
    impl.answers = lambda sessions: stepped.append(list(sessions)) or [None] * len(sessions)
    starved: set[str] = {"near"}
    impl.ready = lambda session: session not in starved         # type: ignore[attr-defined]
    r = runner(impl)
    ahead, near, mid = Job("ahead"), Job("near"), Job("mid")
    for job in (ahead, near, mid):
        r.open(job.ctx, {})
    now = time.time()
    ahead.ctx.deadline, near.ctx.deadline, mid.ctx.deadline = now + 2.0, now + 0.2, now + 30.0
    starved.add("mid")
    assert not r.ready()
    r.step()
    assert stepped == []                    # ahead (2 s at its listener) yields to near, which waits
    starved.discard("mid")
    mid.ctx.deadline = now + 0.8
    assert r.ready()
    r.step()
    assert stepped == [["mid"]]             # one under yield_ahead_s still steps
    starved.clear()                         # near's input came
    r.step()
    assert stepped[-1] == ["near", "mid"]
    near.ctx.deadline = now + 0.9           # no longer near a gap: all of them again
    r.step()
    assert stepped[-1] == ["mid", "near", "ahead"]


def test_a_stream_far_ahead_yields_a_step_to_one_about_to_run_dry() -> None:
    """`yield_ahead_s` (default 1 s): while a session is close to a gap (under half that at its
    listener) or starting (no audio yet, opened under 2 s ago), the ones more than that ahead sit the
    step out; the others still batch, least slack first. 0: never."""
    import time

    from omnid.engines import python_sessions as S

    engine = PythonEngine(stage())
    impl = engine.sessions.impl             # type: ignore[union-attr]
    a, b, c = Job("a", {"n": 50}), Job("b", {"n": 50}), Job("c", {"n": 50})
    for job in (a, b, c):
        engine.add(job.ctx)
    now = time.time()
    a.ctx.deadline, b.ctx.deadline, c.ctx.deadline = now + 1.5, now + 0.8, now + 0.9
    engine.step()
    assert impl.steps[-1] == ["b", "c", "a"]        # nobody near a gap: one batch
    b.ctx.deadline = now + 0.3
    engine.step()
    assert impl.steps[-1] == ["b", "c"]             # b near a gap: a, 1.5 s ahead, yields; c (0.9 s) does not
    a.ctx.deadline = now + 0.95
    engine.step()
    assert impl.steps[-1] == ["b", "c", "a"]        # a no longer that far ahead
    a.ctx.deadline, b.ctx.deadline = now + 1.5, now + 0.8
    d = Job("d", {"n": 50})
    engine.add(d.ctx)                               # starting: no audio out yet
    engine.step()
    assert impl.steps[-1] == ["d", "b", "c"]
    engine.sessions._live["d"].opened -= S.STARTING_S      # type: ignore[union-attr]
    engine.step()
    assert impl.steps[-1][-1] == "a"                # (d, still silent, leads by the time it opened)
    never = PythonEngine(stage(defaults={"yield_ahead_s": 0}))
    x, y = Job("x", {"n": 5}), Job("y", {"n": 5})
    for job in (x, y):
        never.add(job.ctx)
    x.ctx.deadline = time.time() + 2.5
    never.step()
    assert never.sessions.impl.steps[-1] == ["y", "x"]      # type: ignore[union-attr]
    bad = Job("bad", {"yield_ahead_s": "soon"})
    engine.add(bad.ctx)
    assert bad.ctx.outcome is Outcome.FAILED and bad.ctx.error == "yield_ahead_s must be a number of seconds, not 'soon'"
