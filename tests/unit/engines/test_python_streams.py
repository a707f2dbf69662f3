"""`PythonEngine` advancing a generator fed by a window edge with several inputs, in-process.

An output that only the edge's first window carries (a vllm stage's `prompt_token_ids`) leaves its
input's stream empty after that: the generator is advanced whenever any of its streams has a
window, not only when all have (which would wait for the end and stall the stream). A generator
that yields None says "nothing yet": no segment.
"""

from __future__ import annotations

from typing import Any

from conftest import FIXTURES

from omnid.config import StageConfig
from omnid.engines.base import InputStream, RequestContext
from omnid.engines.python_engine import PythonEngine
from omnid.worker.windows import EdgeStream


def _engine(fn: Any) -> PythonEngine:
    engine = PythonEngine(StageConfig(name="s", engine="python", function="teststages:sleep",
                                      python_path=(FIXTURES,), max_inflight=2))
    engine.fn = fn
    return engine


def test_a_generator_reads_the_stream_that_is_ready_and_may_yield_nothing() -> None:
    seen: list[tuple[Any, Any]] = []

    def fn(inputs: dict[str, Any], params: dict[str, Any], ctx: Any) -> Any:
        first = next(inputs["first"])
        for x in inputs["every"]:
            seen.append((first, x))
            if x % 2:
                yield None              # nothing to give for odd windows
            else:
                yield {"out": str(x)}

    stream = EdgeStream(["first", "every"], capacity=2, is_cancelled=lambda: False)
    segments: list[dict[str, Any]] = []
    ctx = RequestContext(job="j", stage="s", inputs={k: InputStream(stream, k) for k in ("first", "every")},
                         params={}, _on_segment=lambda out, last: segments.append(dict(out)) and None)
    engine = _engine(fn)
    engine.add(ctx)
    assert stream.put(0, {"first": "p", "every": 0}, last=False)
    for i in range(1, 6):
        engine.step()
        # the queues never fill: each window was taken before the next came
        assert stream.put(i, {"every": i}, last=i == 5), i
    while engine.has_work():
        engine.step()
    assert seen == [("p", i) for i in range(6)]
    assert [s for s in segments if s] == [{"out": "0"}, {"out": "2"}, {"out": "4"}]     # none for None
    assert ctx.outcome == "finished" and ctx.outputs == {"out": "024"}
