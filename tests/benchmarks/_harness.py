"""Shared helpers of the benchmark suite: real daemons, timed jobs, and the rows of the table.

Apart from the pytest fixtures on purpose (its daemons are its own, so the benchmarks do not move
when the test fixtures do); what both write the same (the TOML config, the stages on the tiny
models) comes from tests/omnidtest.py. Every wait here has a deadline.

- `start_daemon(stages, pipelines)` writes a TOML config into a short /tmp dir, starts
  `python -m omnid -c CONFIG`, waits for `/v1/ready` and returns a `Daemon` (with `ready_s`, the
  seconds from launch to ready). `Daemon.stop()` sends SIGTERM and raises unless it exits 0.
- `Daemon.run(job...)` submits and follows the job's events to its end, every event with the
  daemon's own timestamp `ts` (unix time) beside the client-side submit time.
- `Ctx` is what a bench function gets: quick or not, its deadline, the shared daemons.
- `Row` is one line of the table; `Goal` says what is compared with what.
"""

from __future__ import annotations

import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Generator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar, cast

BENCH_DIR = Path(__file__).resolve().parent
_ROOT = BENCH_DIR.parent.parent

if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))
# tests/ after the repository root: tests/omnictl (the CLI's tests) must never be taken for `omnictl`
if str(BENCH_DIR.parent) not in sys.path:
    sys.path.append(str(BENCH_DIR.parent))

from omnidtest import MODELS, ROOT, TINY_LLM_ARGS, stop_process, tiny_llm, tiny_sd, toml_dumps  # noqa: E402, F401

from omnictl.client import TERMINAL_STATES, Client, ClientError, EventsIdleTimeout  # noqa: E402

Event = dict[str, Any]
N = TypeVar("N", int, float)


class BenchTimeout(TimeoutError):
    """A bench function ran past its own deadline."""


# ------------------------------------------------------------------------- rows of the table


@dataclass
class Goal:
    """`on` ("value" or "ratio") `op` ("<=" or ">=") `limit`; `text` as printed."""
    on: str
    op: str
    limit: float
    text: str

    def met(self, value: float | None, ratio: float | None) -> bool | None:
        x = value if self.on == "value" else ratio
        if x is None:
            return None
        return x <= self.limit if self.op == "<=" else x >= self.limit


def at_most(limit: float, text: str, on: str = "ratio") -> Goal:
    return Goal(on, "<=", limit, text)


def at_least(limit: float, text: str, on: str = "ratio") -> Goal:
    return Goal(on, ">=", limit, text)


@dataclass
class Row:
    figure: str
    value: float | None = None
    unit: str = ""
    anchor: str = ""                  # what the value is compared with, in words
    anchor_value: float | None = None
    anchor_unit: str = ""
    ratio: float | None = None
    ratio_def: str = ""               # e.g. "w8 / w-1"
    goal: Goal | None = None
    note: str = ""
    error: str | None = None
    better: str | None = None         # "lower" or "higher" ratio; None: as the goal says (bench-check)
    bench: str = ""                   # the bench that gave it (set by the runner)

    @property
    def direction(self) -> str | None:
        """Which way the ratio improves ("lower" or "higher"); None when neither the row nor its goal says."""
        if self.better is not None:
            return self.better
        if self.goal is None:
            return None
        return "lower" if self.goal.op == "<=" else "higher"

    @property
    def met(self) -> bool | None:
        if self.error is not None or self.goal is None:
            return None
        return self.goal.met(self.value, self.ratio)

    def to_json(self) -> dict[str, Any]:
        return {"figure": self.figure, "value": self.value, "unit": self.unit, "anchor": self.anchor,
                "anchor_value": self.anchor_value, "anchor_unit": self.anchor_unit, "ratio": self.ratio,
                "ratio_def": self.ratio_def, "goal": self.goal.text if self.goal else None,
                "goal_met": self.met, "better": self.direction, "bench": self.bench, "note": self.note,
                "error": self.error}


def fmt(x: float | None, unit: str = "") -> str:
    """A number with 3 significant figures (more before the point when it is large), and its unit."""
    if x is None:
        return "-"
    if x != 0 and abs(x) < 0.01:
        s = f"{x:.2g}"
    elif abs(x) >= 100:
        s = f"{x:.0f}"
    else:
        s = f"{x:.3g}"
    return f"{s} {unit}".strip() if unit not in ("x", "%") else f"{s}{unit}"


def p50(xs: list[float]) -> float:
    return float(statistics.median(xs))


def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, round(q * (len(s) - 1))))]


# ------------------------------------------------------------------------- context of a bench


class Ctx:
    """What a bench function gets: mode, its deadline, the shared daemons, a progress log."""

    def __init__(self, quick: bool, shared: "Shared", budget_s: float, name: str) -> None:
        self.quick = quick
        self.shared = shared
        self.name = name
        self.problems: list[str] = []       # things to report beside the table (a daemon's bad exit)
        self.started = time.monotonic()
        self.deadline = self.started + budget_s
        self.starting = False               # a shared daemon is starting (its time is not the bench's)

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def check(self, what: str = "") -> None:
        if self.left() <= 0:
            raise BenchTimeout(f"{self.name}: past its time budget{' during ' + what if what else ''}")

    def log(self, msg: str) -> None:
        print(f"  [{self.name} +{time.monotonic() - self.started:5.1f}s] {msg}", file=sys.stderr, flush=True)

    def n(self, full: N, quick: N) -> N:
        return quick if self.quick else full

    def scratch(self, name: str) -> Path:
        """A file path in a scratch dir of this run (kept for a look after a failure)."""
        d = Path(tempfile.gettempdir()) / "omnid-bench"
        d.mkdir(exist_ok=True)
        return d / f"{self.name}-{name}"

    def daemon(self, name: str) -> "Daemon":
        """A shared daemon; the time spent starting it (first use) is added to this bench's budget."""
        t = time.monotonic()
        self.starting = True
        try:
            d = self.shared.get(name)
        finally:
            self.starting = False
        spent = time.monotonic() - t
        if spent > 1:
            self.deadline += spent
            self.log(f"shared daemon {name!r} took {spent:.1f} s to start (added to the budget)")
        return d


# ------------------------------------------------------------------------- config writing


def py_stage(function: str, **extra: Any) -> dict[str, Any]:
    """A python stage running a function of tests/benchmarks/_stages.py."""
    return {"engine": "python", "function": f"_stages:{function}", "python_path": [str(BENCH_DIR)], **extra}


VLLM_ARGS: dict[str, Any] = {"max_model_len": 512, **TINY_LLM_ARGS}


def vllm_stage(max_inflight: int = 1, **extra: Any) -> dict[str, Any]:
    """The tiny Llama on vLLM (CPU), greedy, never stopping early."""
    return tiny_llm({"max_tokens": 256, "temperature": 0.0, "ignore_eos": True}, max_inflight=max_inflight, **extra)


def sd_stage(**extra: Any) -> dict[str, Any]:
    """The tiny Stable Diffusion (64 px) on diffusers (CPU)."""
    return tiny_sd({"num_inference_steps": 10, "guidance_scale": 5.0, "seed": 0}, **extra)


# Daemon settings for benchmarks: quiet logs, patient heartbeats on a busy 2-core machine, room
# for thousands of queued jobs (the throughput rows submit faster than the stages drain).
BENCH_DAEMON: dict[str, Any] = {"log_level": "warning", "heartbeat_timeout_s": 60.0,
                                "max_queued_jobs": 100000, "cancel_grace_s": 10.0}


# ------------------------------------------------------------------------- daemons


@dataclass
class Daemon:
    proc: subprocess.Popen[bytes]
    dir: Path
    socket: Path
    log_path: Path
    launched_at: float                  # time.monotonic() at launch
    launched_wall: float                # time.time() at launch
    ready_s: float | None = None        # launch -> /v1/ready answered 200
    client: Client = field(init=False)

    def __post_init__(self) -> None:
        self.client = Client(str(self.socket), timeout=30)

    def log_tail(self, n: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except FileNotFoundError:
            return ""

    def stages(self) -> dict[str, dict[str, Any]]:
        return {s["name"]: s for s in self.client.stages()["stages"]}

    def submit(self, pipeline: str, inputs: dict[str, Any] | None = None,
               params: dict[str, Any] | None = None) -> str:
        return str(self.client.submit(pipeline, inputs or {}, params)["id"])

    def follow(self, job: str, timeout: float) -> Generator[Event, None, None]:
        """The job's events from its start until its terminal state; TimeoutError past `timeout` s."""
        deadline = time.monotonic() + timeout
        seen = 0
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"job {job}: no end within {timeout:g} s ({seen} events seen)")
            stream = cast(Generator[Event, None, None],           # a generator: it has close()
                          self.client.events(job, idle_timeout=max(0.05, min(left, 10.0))))
            try:
                for i, ev in enumerate(stream):
                    if i < seen:
                        continue        # a reopened stream replays from the start
                    seen += 1
                    yield ev
                    if ev.get("type") == "state" and ev.get("state") in TERMINAL_STATES:
                        return
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"job {job}: no end within {timeout:g} s ({seen} events seen)")
                return
            except EventsIdleTimeout:
                continue
            finally:
                stream.close()

    def events(self, job: str, timeout: float) -> list[Event]:
        return list(self.follow(job, timeout))

    def run(self, pipeline: str, inputs: dict[str, Any] | None = None, params: dict[str, Any] | None = None,
            timeout: float = 120) -> "JobRun":
        """Submit and follow to the end. `t0` is the wall clock just before the POST."""
        t0 = time.time()
        job = self.submit(pipeline, inputs, params)
        events = self.events(job, timeout)
        return JobRun(job, t0, events)

    def drain(self, timeout: float = 60) -> None:
        """Wait until the daemon holds no live job."""
        deadline = time.monotonic() + timeout
        while True:
            live = self.client.health().get("live_jobs", 0)
            if not live:
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"{live} jobs still live after {timeout:g} s")
            time.sleep(0.05)

    def stop(self, timeout: float = 30) -> None:
        """SIGTERM; raise unless it exits 0 within `timeout` s (then it is SIGKILLed)."""
        if not stop_process(self.proc, timeout):
            raise RuntimeError(f"omnid did not exit within {timeout} s of SIGTERM; killed it\n{self.log_tail()}")
        code = self.proc.returncode
        shutil.rmtree(self.dir, ignore_errors=True) if code == 0 else None
        if code != 0:
            raise RuntimeError(f"omnid exited with status {code} (log kept in {self.log_path})\n"
                               f"{self.log_tail(1500)}")


@dataclass
class JobRun:
    job: str
    t0: float                  # wall clock just before submit
    events: list[Event]

    @property
    def state(self) -> str:
        return str(self.events[-1].get("state")) if self.events else "?"

    def first(self, **match: Any) -> Event:
        for ev in self.events:
            if all(ev.get(k) == v for k, v in match.items()):
                return ev
        raise LookupError(f"job {self.job}: no event {match}")

    def all(self, **match: Any) -> list[Event]:
        return [ev for ev in self.events if all(ev.get(k) == v for k, v in match.items())]

    def end_ts(self) -> float:
        return float(self.events[-1]["ts"])

    def check(self) -> "JobRun":
        if self.state != "succeeded":
            raise RuntimeError(f"job {self.job} ended {self.state}: {self.events[-1].get('error')}")
        return self


def short_tmpdir() -> Path:
    """A short directory (Unix socket paths are limited to 107 bytes)."""
    return Path(tempfile.mkdtemp(prefix="omnid-b-", dir="/tmp"))


def launch_daemon(stages: dict[str, Any], pipelines: dict[str, Any], daemon: dict[str, Any] | None = None) -> Daemon:
    """Write the config and start the daemon; do not wait."""
    d = short_tmpdir()
    cfg = {"daemon": {"socket": str(d / "omnid.sock"), "state_dir": str(d / "state"),
                      "lock_dir": str(d / "lock"), **BENCH_DAEMON, **(daemon or {})},
           "stages": stages, "pipelines": pipelines}
    path = d / "omnid.toml"
    path.write_text(toml_dumps(cfg))
    log_path = d / "omnid.log"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    with open(log_path, "ab") as log:
        t, wall = time.monotonic(), time.time()
        proc = subprocess.Popen([sys.executable, "-m", "omnid", "-c", str(path)], stdout=log,
                                stderr=subprocess.STDOUT, env=env, cwd=str(d))
    return Daemon(proc, d, d / "omnid.sock", log_path, t, wall)


def wait_ready(d: Daemon, timeout: float) -> float:
    """Poll /v1/ready until 200; return seconds since launch. Raise if it dies or is late."""
    deadline = time.monotonic() + timeout
    probe = Client(str(d.socket), timeout=5)
    last: Any = "no answer yet"
    while time.monotonic() < deadline:
        if d.proc.poll() is not None:
            raise RuntimeError(f"omnid exited with {d.proc.returncode} before it was ready:\n{d.log_tail()}")
        try:
            ok, body = probe.ready()
            if ok:
                d.ready_s = time.monotonic() - d.launched_at
                return d.ready_s
            last = body
        except (OSError, ClientError) as e:
            last = e
        time.sleep(0.02)
    raise TimeoutError(f"omnid not ready after {timeout:g} s (last /v1/ready: {last}):\n{d.log_tail()}")


def start_daemon(stages: dict[str, Any], pipelines: dict[str, Any], daemon: dict[str, Any] | None = None,
                 timeout: float = 240) -> Daemon:
    d = launch_daemon(stages, pipelines, daemon)
    try:
        wait_ready(d, timeout)
    except BaseException:
        kill_daemon(d)
        raise
    return d


def kill_daemon(d: Daemon) -> None:
    """Best effort: SIGTERM, then SIGKILL; never raises."""
    try:
        stop_process(d.proc, 15)
    except Exception:
        pass


class Shared:
    """Daemons shared by several bench functions, started on first use (once), stopped at the end.

    A daemon that failed to start is remembered: later users get the same error at once.
    """

    def __init__(self, factories: dict[str, Callable[[], Daemon]]) -> None:
        self.factories = factories
        self.daemons: dict[str, Daemon] = {}
        self.failed: dict[str, str] = {}
        self.lock = threading.Lock()

    def get(self, name: str) -> Daemon:
        with self.lock:
            if name in self.failed:
                raise RuntimeError(f"shared daemon {name!r} did not start: {self.failed[name]}")
            if name not in self.daemons:
                try:
                    self.daemons[name] = self.factories[name]()
                except Exception as e:
                    self.failed[name] = f"{type(e).__name__}: {str(e)[:500]}"
                    raise
            d = self.daemons[name]
        if d.proc.poll() is not None:
            raise RuntimeError(f"shared daemon {name!r} exited with {d.proc.returncode}:\n{d.log_tail()}")
        return d

    def stop(self, name: str) -> list[str]:
        """Stop one shared daemon (if it was started); return the problems."""
        d = self.daemons.pop(name, None)
        if d is None:
            return []
        try:
            d.stop()
        except Exception as e:
            return [f"shared daemon {name}: {e}"]
        return []

    def stop_all(self) -> list[str]:
        """Stop every shared daemon; return the problems (exit status not 0)."""
        problems: list[str] = []
        for name, d in self.daemons.items():
            try:
                d.stop()
            except Exception as e:
                problems.append(f"shared daemon {name}: {e}")
        self.daemons.clear()
        return problems


def health_p50(d: Daemon, n: int) -> float:
    """The median of `n` bare `GET /v1/health` round trips, one after the other (s)."""
    lat = []
    for _ in range(n):
        t = time.perf_counter()
        d.client.health()
        lat.append(time.perf_counter() - t)
    return p50(lat)


def in_threads(n: int, fn: Callable[[int], Any], timeout: float) -> list[Any]:
    """Run fn(0..n-1) in n threads; their results (or exceptions) in order; bounded by `timeout`."""
    out: list[Any] = [None] * n

    def body(i: int) -> None:
        try:
            out[i] = fn(i)
        except BaseException as e:     # handed back to the caller
            out[i] = e

    threads = [threading.Thread(target=body, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + timeout
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    if any(t.is_alive() for t in threads):
        raise TimeoutError(f"{sum(t.is_alive() for t in threads)} of {n} threads still running after {timeout:g} s")
    return out


def raise_first(results: list[Any]) -> None:
    for r in results:
        if isinstance(r, BaseException):
            raise r


# ------------------------------------------------------------------------- the shared daemons


def engines_config() -> tuple[dict[str, Any], dict[str, Any]]:
    """vLLM (batched and one at a time), diffusers and two streaming consumers, in one daemon.

    Pipelines: s8 / sall (streaming, window 8 / -1), llm / llm1 (vLLM alone, max_inflight 16 / 1),
    draw / drawb (diffusers alone, one job at a time / batched up to 8), t2i (vLLM expands the prompt, diffusers draws it).
    """
    stages = {
        "gen": vllm_stage(max_inflight=16),
        "gen1": vllm_stage(max_inflight=1),
        "draw": sd_stage(),
        "drawb": sd_stage(max_inflight=8),      # in-stage batching: jobs join the batch at a denoising step
        "down8": py_stage("consume_windows"),
        "downall": py_stage("consume_windows"),
    }
    pipelines = {
        "s8": {"stages": ["gen", "down8"],
               "edges": [{"from": "gen", "to": "down8", "window": 8, "map": {"text": "text"}}]},
        "sall": {"stages": ["gen", "downall"],
                 "edges": [{"from": "gen", "to": "downall", "window": -1, "map": {"text": "text"}}]},
        "llm": {"stages": ["gen"]},
        "llm1": {"stages": ["gen1"]},
        "draw": {"stages": ["draw"]},
        "drawb": {"stages": ["drawb"]},
        "t2i": {"stages": ["gen", "draw"], "edges": [{"from": "gen", "to": "draw", "map": {"prompt": "text"}}]},
    }
    return stages, pipelines


def control_config() -> tuple[dict[str, Any], dict[str, Any]]:
    """Python stages only: no-op chains of 1, 2 and 3 stages, two sleepers, a tensor producer/consumer,
    a text stream (`seg`)."""
    stages = {
        "n1": py_stage("noop"), "n2": py_stage("noop"), "n3": py_stage("noop"),
        "sa": py_stage("sleep"), "sb": py_stage("sleep"),
        "tx": py_stage("tensor_make"), "ty": py_stage("tensor_take"),
        "seg": py_stage("segments"),
    }
    pipelines = {
        "p1": {"stages": ["n1"]}, "p2": {"stages": ["n1", "n2"]}, "p3": {"stages": ["n1", "n2", "n3"]},
        "ab": {"stages": ["sa", "sb"]},
        "tensor": {"stages": ["tx", "ty"]},
        "seg": {"stages": ["seg"]},
    }
    return stages, pipelines


def shared_daemons() -> Shared:
    return Shared({"engines": lambda: start_daemon(*engines_config(), timeout=300),
                   "control": lambda: start_daemon(*control_config(), timeout=120)})
