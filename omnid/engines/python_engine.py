"""The `python` engine: a user's `package.module:function` as a stage.

Runs in a stage worker's main thread. The function is
`fn(inputs: dict, params: dict, ctx) -> dict` or a generator yielding such
dicts as segments. A plain function runs to its end inside `add` (it should
poll `ctx.cancelled()`); a generator is advanced one segment per `step`, so a
cancel between segments stops it at once. A function that ignores a cancel is
the supervisor's business: past the grace period it restarts the worker.

An input fed by a streaming edge (`window = N`) is an iterable of window values
(`omnid.worker.windows.InputStream`). With `max_inflight > 1` several jobs'
generators are advanced in turn, each only when its next window is there, so one
job waiting for its stream never holds up the others.

A generator's final outputs are its segments merged in order: `str` and
`bytes` values of the same name are concatenated, any other value is replaced
by the latest one.
"""

from __future__ import annotations

import importlib
import inspect
import sys
import traceback
from collections.abc import Callable, Generator
from typing import Any

from omnid.config import StageConfig
from omnid.params import merged
from omnid.worker.windows import InputStream
from omnid.engines.base import Cancelled, Engine, RequestContext


def import_ref(ref: str, python_path: tuple[str, ...] = ()) -> Callable[..., Any]:
    """Import `package.module:function`, with `python_path` searched first."""
    for p in reversed(python_path):
        if p not in sys.path:
            sys.path.insert(0, p)
    module_name, _, func_name = ref.partition(":")
    module = importlib.import_module(module_name)
    try:
        fn: Callable[..., Any] = getattr(module, func_name)
    except AttributeError:
        raise ImportError(f"module {module_name!r} has no attribute {func_name!r}") from None
    if not callable(fn):
        raise ImportError(f"{ref} is not callable")
    return fn


def user_error(e: BaseException) -> str:
    """The exception and the innermost frame, for a job's error message."""
    tb = traceback.extract_tb(e.__traceback__)
    where = f" (at {tb[-1].filename}:{tb[-1].lineno})" if tb else ""
    return f"{type(e).__name__}: {e}{where}"


def merge_segment(acc: dict[str, Any], seg: dict[str, Any]) -> None:
    for k, v in seg.items():
        prev = acc.get(k)
        if isinstance(v, str) and isinstance(prev, str):
            acc[k] = prev + v
        elif isinstance(v, bytes) and isinstance(prev, bytes):
            acc[k] = prev + v
        else:
            acc[k] = v


class PythonEngine(Engine):
    def __init__(self, stage: StageConfig) -> None:
        self.stage = stage
        self.fn = import_ref(stage.function or "", tuple(str(p) for p in stage.python_path))
        # job -> (its context, the user's generator, the outputs merged so far)
        self._gens: dict[str, tuple[RequestContext, Generator[Any, Any, Any], dict[str, Any]]] = {}

    def info(self) -> dict[str, Any]:
        return {"function": self.stage.function}

    def add(self, ctx: RequestContext) -> None:
        params = merged(self.stage.defaults, ctx.params)
        try:
            result = self.fn(ctx.inputs, params, ctx)
        except Cancelled:
            ctx.stopped()
            return
        except Exception as e:
            ctx.fail(user_error(e))
            return
        if inspect.isgenerator(result):
            self._gens[ctx.job] = (ctx, result, {})
        elif ctx.cancelled():
            ctx.stopped()
        elif result is None:
            ctx.finish({})
        else:
            ctx.finish(result)

    def step(self) -> None:
        for job in list(self._gens):
            ctx, gen, acc = self._gens[job]
            if not _inputs_ready(ctx):
                continue                    # its next window is not here: advance the others
            try:
                seg = next(gen)
            except StopIteration:
                del self._gens[job]
                ctx.segment({}, is_last=True)
                ctx.finish(acc)
                continue
            except Cancelled:
                del self._gens[job]
                ctx.stopped()
                continue
            except Exception as e:
                del self._gens[job]
                ctx.fail(user_error(e))
                continue
            if not isinstance(seg, dict):
                del self._gens[job]
                gen.close()
                ctx.fail(f"generator yielded {type(seg).__name__}, not a dict of named outputs")
                continue
            merge_segment(acc, seg)
            ctx.segment(seg)

    def abort(self, job: str) -> None:
        entry = self._gens.pop(job, None)
        if entry is not None:
            ctx, gen, _ = entry
            try:
                gen.close()
            except Exception:
                pass
            ctx.stopped()

    def has_work(self) -> bool:
        return bool(self._gens)

    def ready(self) -> bool:
        return any(_inputs_ready(ctx) for ctx, _, _ in self._gens.values())


def _inputs_ready(ctx: RequestContext) -> bool:
    """Advancing the job's generator would not block on a streamed input, and its own streamed
    output has room downstream (else it waits: that is the stream's backpressure)."""
    return not ctx.held() and all(v.ready() for v in ctx.inputs.values() if isinstance(v, InputStream))
