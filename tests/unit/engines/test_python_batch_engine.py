"""`PythonEngine` with a `batch_function`, in-process: real RequestContexts, no worker, no daemon.

The engine is driven as the worker drives it: `add` each request, then `step`. The batch functions
are tests/fixtures/batchstages.py's, or local ones set on `engine.batch_fn`. Also: what `--check`'s
parser says about `batch_function`.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
from conftest import FIXTURES

from omnid import config as C
from omnid.config import StageConfig
from omnid.engines.base import Cancelled, InputStream, RequestContext
from omnid.engines.python_engine import PythonEngine
from omnid.worker.windows import EdgeStream


def stage(max_inflight: int = 8, function: str | None = None, batch_function: str | None = "batchstages:upper",
          defaults: dict[str, Any] | None = None) -> StageConfig:
    return StageConfig(name="b", engine="python", function=function, batch_function=batch_function,
                       python_path=(FIXTURES,), max_inflight=max_inflight, defaults=defaults or {})


class Job:
    """One request: its context, and a cancel switch the test flips."""

    def __init__(self, name: str, inputs: dict[str, Any] | None = None, params: dict[str, Any] | None = None) -> None:
        self.cancel = False
        self.ctx = RequestContext(job=name, stage="b", inputs=inputs if inputs is not None else {"text": name},
                                  params=params or {}, _is_cancelled=lambda: self.cancel)


def jobs(n: int) -> list[Job]:
    return [Job(f"j{i}") for i in range(n)]


def run(engine: PythonEngine, js: list[Job]) -> None:
    for j in js:
        engine.add(j.ctx)
    steps = 0
    while engine.has_work():
        engine.step()
        steps += 1
        assert steps < 100


class Recorder:
    """A batch function that records what it was called with and answers from `answer`."""

    def __init__(self, answer: Any = None) -> None:
        self.calls: list[tuple[list[dict[str, Any]], list[dict[str, Any]], list[str]]] = []
        self.answer = answer
        self.during: Any = None            # called inside the call (e.g. to cancel a request)

    def __call__(self, inputs: list[dict[str, Any]], params: list[dict[str, Any]],
                 ctxs: list[RequestContext]) -> Any:
        self.calls.append((inputs, params, [c.job for c in ctxs]))
        if self.during is not None:
            self.during()
        if self.answer is not None:
            return self.answer(inputs)
        return [{"text": str(i["text"]).upper()} for i in inputs]


# ------------------------------------------------------------------------- batching


def test_one_call_for_every_queued_request_outputs_in_order() -> None:
    engine = PythonEngine(stage(defaults={"tag": "d"}))
    assert engine.batching
    js = jobs(5)
    js[3].ctx.params = {"tag": "own"}
    for j in js:
        engine.add(j.ctx)
        assert not j.ctx.done               # `add` only queues
    assert engine.has_work() and engine.ready()
    engine.step()
    assert not engine.has_work()
    assert [j.ctx.outcome for j in js] == ["finished"] * 5
    for i, j in enumerate(js):
        out = j.ctx.outputs or {}
        tag = "own" if i == 3 else "d"      # stage defaults merged with the job's params
        assert out["text"] == f"{tag}:J{i}" and out["index"] == i and out["size"] == 5


def test_a_batch_is_at_most_max_inflight() -> None:
    engine = PythonEngine(stage(max_inflight=3))
    rec = engine.batch_fn = Recorder()
    run(engine, jobs(5))
    assert [calls[2] for calls in rec.calls] == [["j0", "j1", "j2"], ["j3", "j4"]]


def test_an_exception_in_a_slot_fails_that_request_alone() -> None:
    engine = PythonEngine(stage())
    js = [Job("a"), Job("bad", {"text": "boom"}), Job("c")]
    run(engine, js)
    assert [j.ctx.outcome for j in js] == ["finished", "failed", "finished"]
    assert js[1].ctx.error == "ValueError: cannot shout 'boom'"
    assert (js[2].ctx.outputs or {})["text"] == "up:C"


def test_an_exception_raised_fails_the_whole_batch() -> None:
    engine = PythonEngine(stage(batch_function="batchstages:raises"))
    js = jobs(3)
    run(engine, js)
    assert [j.ctx.outcome for j in js] == ["failed"] * 3
    assert all((j.ctx.error or "").startswith("RuntimeError: the whole batch of 3 failed (at ") for j in js)


def test_a_raised_cancelled_stops_only_the_cancelled_requests() -> None:
    engine = PythonEngine(stage())
    js = jobs(2)

    def cancel_first(inputs: list[dict[str, Any]], params: list[dict[str, Any]], ctxs: list[RequestContext]) -> Any:
        js[0].cancel = True
        raise Cancelled()
    engine.batch_fn = cancel_first
    run(engine, js)
    assert [j.ctx.outcome for j in js] == ["stopped", "failed"]


def test_a_request_cancelled_before_the_call_is_not_passed() -> None:
    engine = PythonEngine(stage())
    rec = engine.batch_fn = Recorder()
    js = jobs(3)
    for j in js:
        engine.add(j.ctx)
    js[1].cancel = True                     # queued, not yet called
    engine.step()
    assert rec.calls[0][2] == ["j0", "j2"]
    assert [j.ctx.outcome for j in js] == ["finished", "stopped", "finished"]


def test_a_request_cancelled_during_the_call_ends_stopped_its_result_dropped() -> None:
    engine = PythonEngine(stage())
    rec = engine.batch_fn = Recorder()
    js = jobs(3)

    def cancel_middle() -> None:
        js[1].cancel = True
    rec.during = cancel_middle
    run(engine, js)
    assert rec.calls[0][2] == ["j0", "j1", "j2"]
    assert [j.ctx.outcome for j in js] == ["finished", "stopped", "finished"]
    assert js[1].ctx.outputs is None


def test_a_request_cancelled_before_add_never_queues() -> None:
    engine = PythonEngine(stage())
    j = Job("x")
    j.cancel = True
    engine.add(j.ctx)
    assert j.ctx.outcome == "stopped" and not engine.has_work()


def test_abort_of_a_queued_request() -> None:
    engine = PythonEngine(stage())
    rec = engine.batch_fn = Recorder()
    js = jobs(3)
    for j in js:
        engine.add(j.ctx)
    engine.abort("j0")
    engine.abort("j0")                      # idempotent
    assert js[0].ctx.outcome == "stopped"
    engine.step()
    assert rec.calls[0][2] == ["j1", "j2"]
    assert not engine.has_work()


@pytest.mark.parametrize("answer, error", [
    (lambda inputs: [{"text": "x"}] * (len(inputs) - 1), "returned 2 results for 3 requests"),
    (lambda inputs: {"text": "x"}, "returned dict for 3 requests"),
    (lambda inputs: None, "returned NoneType for 3 requests"),
])
def test_a_result_that_is_not_one_per_request_fails_them_all(answer: Any, error: str) -> None:
    engine = PythonEngine(stage())
    engine.batch_fn = Recorder(answer)
    js = jobs(3)
    run(engine, js)
    assert [j.ctx.outcome for j in js] == ["failed"] * 3
    assert all(error in (j.ctx.error or "") for j in js), js[0].ctx.error


def test_slots_none_and_not_a_dict() -> None:
    engine = PythonEngine(stage())
    engine.batch_fn = Recorder(lambda inputs: [None, ["a", "list"], ("a", "tuple")])
    js = jobs(3)
    run(engine, js)
    assert js[0].ctx.outcome == "finished" and js[0].ctx.outputs == {}
    assert js[1].ctx.error == "stage returned list, not a dict of named outputs"
    assert js[2].ctx.error == "stage returned tuple, not a dict of named outputs"


# ------------------------------------------------------------------------- which function serves


def test_max_inflight_1_with_a_function_is_todays_engine() -> None:
    engine = PythonEngine(stage(max_inflight=1, function="batchstages:single"))
    rec = engine.batch_fn = Recorder()
    assert not engine.batching
    j = Job("x")
    engine.add(j.ctx)                       # runs to its end inside `add`, as before
    assert j.ctx.outcome == "finished" and (j.ctx.outputs or {})["text"] == "single:X"
    assert not engine.has_work() and rec.calls == []


def test_max_inflight_1_with_only_a_batch_function_batches_of_one() -> None:
    engine = PythonEngine(stage(max_inflight=1))
    rec = engine.batch_fn = Recorder()
    js = jobs(2)
    for j in js:                            # (the worker would admit one at a time)
        run(engine, [j])
    assert [c[2] for c in rec.calls] == [["j0"], ["j1"]]


def test_with_both_and_max_inflight_above_1_the_batch_function_serves_even_one() -> None:
    engine = PythonEngine(stage(function="batchstages:single"))
    assert engine.batching
    j = Job("x")
    run(engine, [j])
    assert (j.ctx.outputs or {})["text"] == "up:X"


def _streamed(name: str) -> Job:
    stream = EdgeStream(["text"], 4, is_cancelled=lambda: False)
    stream.put(0, {"text": "win"}, True)
    return Job(name, {"text": InputStream(stream, "text")})


def test_a_streamed_request_goes_to_the_function() -> None:
    engine = PythonEngine(stage(function="teststages:collect"))
    engine.fn = lambda inputs, params, ctx: {"text": "".join(inputs["text"])}
    rec = engine.batch_fn = Recorder()
    js = [_streamed("s"), Job("plain")]
    run(engine, js)
    assert (js[0].ctx.outputs or {})["text"] == "win"
    assert [c[2] for c in rec.calls] == [["plain"]]


def test_a_streamed_request_without_a_function_fails_saying_why() -> None:
    engine = PythonEngine(stage())
    j = _streamed("s")
    engine.add(j.ctx)
    assert j.ctx.outcome == "failed" and "cannot take a streamed input" in (j.ctx.error or "")


def test_a_generator_batch_function_is_refused_at_load() -> None:
    with pytest.raises(TypeError, match="generator function"):
        PythonEngine(stage(batch_function="teststages:count"))


def test_info_names_both() -> None:
    info = PythonEngine(stage(function="batchstages:single")).info()
    assert info == {"function": "batchstages:single", "batch_function": "batchstages:upper", "batching": True,
                    "loaded": [], "lazy": False}


# ------------------------------------------------------------------------- the config parser


def _parse(stages: dict[str, Any], base: Path) -> C.Config:
    return C.parse(copy.deepcopy({"stages": stages, "pipelines": {"p": {"stages": list(stages)}}}), base=base)


def _problems(stages: dict[str, Any], base: Path) -> dict[str, list[str]]:
    with pytest.raises(C.ConfigError) as err:
        _parse(stages, base)
    found: dict[str, list[str]] = {}
    for p in err.value.problems:
        found.setdefault(p.path, []).append(p.message)
    return found


def _py(**keys: Any) -> dict[str, Any]:
    return {"engine": "python", "python_path": [str(FIXTURES)], **keys}


def test_config_batch_function_alone_or_beside_a_function(tmp_path: Path) -> None:
    cfg = _parse({"a": _py(batch_function="batchstages:upper", max_inflight=8),
                  "b": _py(function="batchstages:single", batch_function="batchstages:upper")}, tmp_path)
    assert cfg.stages["a"].batch_function == "batchstages:upper" and cfg.stages["a"].function is None
    assert cfg.stages["b"].function == "batchstages:single"
    assert _parse({"a": _py(function="batchstages:single")}, tmp_path).stages["a"].batch_function is None


def test_config_batch_function_problems(tmp_path: Path) -> None:
    models = tmp_path / "llm"
    models.mkdir()
    (models / "config.json").write_text("{}")
    found = _problems({"a": _py(batch_function="nosuchmodule_xyz:fn"),
                       "b": _py(batch_function="not a ref"),
                       "c": _py(),
                       "d": {"engine": "vllm", "model": str(models), "batch_function": "batchstages:upper"},
                       "e": _py(batch_function=3)}, tmp_path)
    assert found["stages.a.batch_function"] == [f"module 'nosuchmodule_xyz' cannot be found in python_path "
                                                f"({FIXTURES}; relative folders are from the config file's "
                                                "folder) nor on sys.path"]
    assert found["stages.b.batch_function"] == ["must be \"package.module:function\", not 'not a ref'"]
    assert found["stages.c.function"] == ["is required for engine 'python' (or a batch_function, or sessions)"]
    assert found["stages.d.batch_function"] == ["only python stages take a batch_function, not 'vllm'"]
    assert "stages.e.batch_function" in found
