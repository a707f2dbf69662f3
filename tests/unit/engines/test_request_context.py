"""A request's context as the worker hooks it up (omnid/engines/base.py: `RequestContext.attach`):
its progress and segment events go to the worker, its cancel and hold are the worker's to say, and
each segment feeds what the worker gives it (whose error fails the request). In-process, no worker.
"""

from __future__ import annotations

from typing import Any

from omnid import protocol as P
from omnid.engines.base import Outcome, RequestContext


def test_a_context_without_hooks_reports_nowhere() -> None:
    ctx = RequestContext(job="j", stage="s", inputs={}, params={})
    ctx.progress(1, 2)
    ctx.segment({"text": "a"})
    assert not ctx.cancelled() and not ctx.held() and ctx.segments == 1 and not ctx.done


def test_the_workers_hooks_hear_and_decide() -> None:
    events: list[object] = []
    fed: list[tuple[dict[str, Any], bool]] = []
    state = {"cancelled": False, "held": True}

    def on_segment(outputs: dict[str, Any], is_last: bool) -> str | None:
        fed.append((outputs, is_last))
        return "no room downstream" if is_last else None

    ctx = RequestContext(job="j", stage="s", inputs={}, params={})
    ctx.attach(emit=events.append, is_cancelled=lambda: state["cancelled"], is_held=lambda: state["held"],
               on_segment=on_segment)
    ctx.progress(3, 10)
    ctx.segment({"text": "tok"})
    assert events == [P.Progress(job="j", done=3, total=10),
                      P.Segment(job="j", index=0, is_last=False, text="tok", audio_s=0.0)]
    assert fed == [({"text": "tok"}, False)]
    assert ctx.held() and not ctx.cancelled()
    state.update(cancelled=True, held=False)
    assert ctx.cancelled() and not ctx.held()
    ctx.segment({"text": "end"}, is_last=True)            # the hook's error fails the request
    assert ctx.outcome is Outcome.FAILED and ctx.error == "no room downstream"
