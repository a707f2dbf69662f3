"""The `python` engine: a user's `package.module:function` as a stage.

Runs in a stage worker's main thread. The function is
`fn(inputs: dict, params: dict, ctx) -> dict` or a generator yielding such
dicts as segments. A plain function runs to its end inside `add` (it should
poll `ctx.cancelled()`); a generator is advanced one segment per `step`, so a
cancel between segments stops it at once. A function that ignores a cancel is
the supervisor's business: past the grace period it restarts the worker.

An input fed by a streaming edge (`window = N`) is an iterable of window values
(`omnid.engines.base.InputStream`). With `max_inflight > 1` several jobs'
generators are advanced in turn, each only when one of its streams has a window
(or its end) to read, so one job waiting for its stream never holds up the
others. A generator may yield None: "nothing to give yet" (no segment); it is
advanced again once a stream is ready, so it need not block reading one.

A generator's final outputs are its segments merged in order: `str` and
`bytes` values of the same name are concatenated, any other value is replaced
by the latest one.

Ready means loaded: a function (or batch function) may carry a `load` attribute, a callable
that the engine calls once as the stage starts, before the stage says it is ready, with a
`LoadContext` (`stage`, `model`, `devices`): what it loads (weights, say) is the function's to
keep. A stage with `lazy = true` skips that call (its function loads on its first job), and says
so in `omnictl stages` and `/v1/ready`.

A stage may also name a `batch_function`, called once for several requests:
`fn(inputs: list[dict], params: list[dict], ctxs: list[RequestContext]) ->
list[dict | Exception]`, one result per request, in order. `add` only queues a
request; `step` takes every queued one (up to `max_inflight`; the worker admits
no more than that), drops those already cancelled (`stopped`), and calls the
function once for the rest. A result slot holding an `Exception` instance fails
that request alone; an exception raised fails them all; a request cancelled
during the call ends `stopped`, whatever its slot holds. Which requests batch:
- only `batch_function`: every request, in batches of up to `max_inflight`
  (of one when `max_inflight = 1`);
- both, `max_inflight = 1`: `function` alone, exactly as without a batch function;
- both, `max_inflight > 1`: `batch_function` for every request (a batch may be of
  one), `function` only for requests with a streamed input (see below).
A request with a streamed input (`window = N`) never batches: it goes to
`function`, and fails when the stage has none.

Or a stage names `sessions`, a class whose instance steps every live job's session together, one
batched call per step, jobs joining and leaving between steps: `omnid.engines.python_sessions`.
"""

from __future__ import annotations

import importlib
import inspect
import sys
import traceback
from collections.abc import Callable, Generator, Mapping
from dataclasses import dataclass
from typing import Any

from omnid.config_types import StageConfig
from omnid.engines.base import Cancelled, Engine, InputStream, RequestContext
from omnid.engines.capabilities import PYTHON
from omnid.engines.python_sessions import SessionRunner, streams_ready
from omnid.params import merged


@dataclass(frozen=True)
class LoadContext:
    """What a function's `load` hook is given as its stage starts."""
    stage: str
    model: str | None
    devices: tuple[int, ...]
    max_inflight: int = 1           # the jobs the stage runs at once (a sessions class: its live sessions)


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


def merge_segment(acc: dict[str, Any], seg: Mapping[str, Any]) -> None:
    for k, v in seg.items():
        prev = acc.get(k)
        if isinstance(v, str) and isinstance(prev, str):
            acc[k] = prev + v
        elif isinstance(v, bytes) and isinstance(prev, bytes):
            acc[k] = prev + v
        else:
            acc[k] = v


@dataclass
class _Queued:
    """A request waiting for the next batch call, with its merged parameters."""

    ctx: RequestContext
    params: dict[str, Any]


class PythonEngine(Engine):
    capabilities = PYTHON          # (engines/capabilities.py: what it can do)

    def __init__(self, stage: StageConfig) -> None:
        self.stage = stage
        python_path = tuple(str(p) for p in stage.python_path)
        self.sessions: SessionRunner | None = None
        if stage.sessions:
            cls = import_ref(stage.sessions, python_path)
            ctx = self._load_context()
            self.sessions = SessionRunner(lambda: cls(ctx), stage.sessions, merge_segment, user_error, stage.lazy)
        self.fn: Callable[..., Any] | None = import_ref(stage.function, python_path) if stage.function else None
        self.batch_fn: Callable[..., Any] | None = None
        if stage.batch_function:
            self.batch_fn = import_ref(stage.batch_function, python_path)
            if inspect.isgeneratorfunction(self.batch_fn):
                raise TypeError(f"batch_function {stage.batch_function} is a generator function: it must "
                                "return a list of results, one per request")
        if self.fn is None and self.batch_fn is None and self.sessions is None:
            raise ValueError(f"python stage {stage.name!r} names no function, batch_function nor sessions")
        self.loaded = [] if stage.lazy else self._load_hooks()
        if self.sessions is not None and not stage.lazy:
            self.loaded.append(f"{stage.sessions}()")
        self.max_batch = max(1, stage.max_inflight)
        # Requests go to the batch function unless `function` is there too and max_inflight = 1.
        self.batching = self.batch_fn is not None and (self.fn is None or self.max_batch > 1)
        self._queue: list[_Queued] = []     # batching: requests waiting for the next batch call, oldest first
        # job -> (its context, the user's generator, the outputs merged so far)
        self._gens: dict[str, tuple[RequestContext, Generator[Any, Any, Any], dict[str, Any]]] = {}

    def _load_context(self) -> LoadContext:
        return LoadContext(stage=self.stage.name, model=str(self.stage.model) if self.stage.model else None,
                           devices=self.stage.devices, max_inflight=self.stage.max_inflight)

    def _load_hooks(self) -> list[str]:
        """Call each function's `load` hook (once per hook); the names of those called."""
        ctx = self._load_context()
        called: list[str] = []
        seen: set[int] = set()
        for ref, fn in ((self.stage.function, self.fn), (self.stage.batch_function, self.batch_fn)):
            hook = getattr(fn, "load", None)
            if fn is None or not callable(hook) or id(hook) in seen:
                continue
            seen.add(id(hook))
            hook(ctx)
            called.append(f"{ref}.load")
        return called

    def info(self) -> dict[str, Any]:
        info: dict[str, Any] = {"function": self.stage.function, "batch_function": self.stage.batch_function,
                                "batching": self.batching, "loaded": self.loaded, "lazy": self.stage.lazy}
        return {**info, **self.live_info()}

    def live_info(self) -> dict[str, Any]:
        info: dict[str, Any] = {"loaded": list(self.loaded)}       # a lazy stage loads on its first job
        if self.sessions is not None:
            info["sessions"] = {"class": self.stage.sessions, "live": len(self.sessions)}
        return info

    def add(self, ctx: RequestContext) -> None:
        params = merged(self.stage.defaults, ctx.params)
        ctx.model = str(self.stage.model) if self.stage.model is not None else None
        if self.sessions is not None:
            if ctx.cancelled():
                ctx.stopped()
            else:
                self.sessions.open(ctx, params)
            return
        streamed = any(isinstance(v, InputStream) for v in ctx.inputs.values())
        if self.batching and not streamed:
            if ctx.cancelled():
                ctx.stopped()
            else:
                self._queue.append(_Queued(ctx, params))
            return
        if self.fn is None:
            ctx.fail(f"stage {self.stage.name!r} has only a batch_function, which cannot take a streamed "
                     "input (window = N); give the stage a `function` for streamed jobs")
            return
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
        if self.sessions is not None:
            self.sessions.step()
        if self._queue:
            self._run_batch()
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
            if seg is None:                 # "nothing yet": come back when an input is ready
                continue
            if not isinstance(seg, dict):
                del self._gens[job]
                gen.close()
                ctx.fail(f"generator yielded {type(seg).__name__}, not a dict of named outputs")
                continue
            merge_segment(acc, seg)
            ctx.segment(seg)

    def _run_batch(self) -> None:
        """One call of the batch function for the oldest queued requests (up to max_inflight)."""
        batch, self._queue = self._queue[:self.max_batch], self._queue[self.max_batch:]
        live: list[_Queued] = []
        for queued in batch:
            if queued.ctx.cancelled():
                queued.ctx.stopped()            # cancelled before the call: not passed to it
            else:
                live.append(queued)
        if not live:
            return
        assert self.batch_fn is not None
        ctxs = [q.ctx for q in live]
        try:
            results = self.batch_fn([c.inputs for c in ctxs], [q.params for q in live], ctxs)
        except Exception as e:                  # Cancelled included: it ends only the cancelled requests
            _end_all(ctxs, user_error(e))
            return
        if not isinstance(results, (list, tuple)) or len(results) != len(ctxs):
            got = f"{len(results)} results" if isinstance(results, (list, tuple)) else type(results).__name__
            _end_all(ctxs, f"batch_function {self.stage.batch_function} returned {got} for {len(ctxs)} "
                           f"requests; it must return a list of one result per request, in order")
            return
        for ctx, result in zip(ctxs, results):
            if ctx.cancelled() or isinstance(result, Cancelled):
                ctx.stopped()                   # cancelled during the call: its result is dropped
            elif isinstance(result, Exception):
                ctx.fail(user_error(result))
            elif result is None:
                ctx.finish({})
            else:
                ctx.finish(result)              # not a dict: finish fails it, saying so

    def abort(self, job: str) -> None:
        if self.sessions is not None:
            self.sessions.abort(job)
        for queued in [q for q in self._queue if q.ctx.job == job]:
            self._queue.remove(queued)
            queued.ctx.stopped()
        entry = self._gens.pop(job, None)
        if entry is not None:
            ctx, gen, _ = entry
            try:
                gen.close()
            except Exception:
                pass
            ctx.stopped()

    def has_work(self) -> bool:
        return bool(self._queue) or bool(self._gens) or (self.sessions is not None and self.sessions.has_work())

    def ready(self) -> bool:
        return bool(self._queue) or any(_inputs_ready(ctx) for ctx, _, _ in self._gens.values()) \
            or (self.sessions is not None and self.sessions.ready())


def _end_all(ctxs: list[RequestContext], error: str) -> None:
    """The whole batch call failed: each request fails with `error`, a cancelled one ends stopped."""
    for ctx in ctxs:
        if ctx.cancelled():
            ctx.stopped()
        else:
            ctx.fail(error)


def _inputs_ready(ctx: RequestContext) -> bool:
    """The job's generator has something to read (a window, or a stream's end, on one of its
    streamed inputs; with none, always), and its own streamed output has room downstream (else it
    waits: that is the stream's backpressure).

    Any one stream, not all: the inputs of one edge arrive together, window by window, but an
    output that only the first window carries (a vllm stage's `prompt_token_ids`) leaves its
    stream empty until the end; waiting for all would wait for the end, and fill the others'
    queues meanwhile (a stall)."""
    return not ctx.held() and streams_ready(ctx)
