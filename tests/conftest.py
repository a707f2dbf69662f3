"""Shared fixtures: real daemons in real processes, on real Unix sockets.

`start_daemon(stages=..., pipelines=..., daemon=...)` writes a TOML config,
runs `python -m omnid -c CONFIG` as a subprocess, waits until `/v1/ready`
answers 200 (or the process dies: then the test fails with its log), and
returns a `RunningDaemon`. At teardown every daemon gets SIGTERM, and the
fixture checks that it exited with status 0 (or the status the test declared
with `expect_exit=`, or by killing it through `RunningDaemon.kill9()`) and that
none of its stage workers outlived it.

No wait here is unbounded: every wait has a deadline and, when it passes,
fails naming what it waited for, with the job's and the stages' state and the
tail of the daemon's log. Event streams are read with an idle timeout
(`Client.events(..., idle_timeout=)`), so a daemon that goes quiet cannot hang
a test either.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import inject
import psutil
import pytest

# The repository's own packages first: tests/omnictl (the CLI's tests) must never be taken for the
# `omnictl` package when pytest runs from another directory.
_REPO = str(Path(__file__).resolve().parent.parent)
if sys.path[:1] != [_REPO]:
    sys.path.insert(0, _REPO)

# The helpers the benchmarks share (tests/omnidtest.py), re-exported: tests import them from here.
from omnidtest import (  # noqa: F401
    EXAMPLES,
    FIXTURES,
    MODELS,
    ROOT,
    TINY_LLM_ARGS,
    build_tiny_models,
    demo_stage,
    python_stage,
    stop_process,
    tiny_llm,
    tiny_sd,
    toml_dumps,
)

from omnictl.client import TERMINAL_STATES, Client, ClientError, DaemonUnreachable, EventsIdleTimeout

# Every process this session starts (daemons, workers, engine cores, Ray's nodes, CLIs) inherits
# this mark in its environment; at the session's end none may be left (`pytest_sessionfinish`).
SESSION_MARK = "OMNID_TEST_SESSION"
os.environ[SESSION_MARK] = f"{os.getpid()}-{time.time_ns()}"
LEFTOVER_GRACE_S = 15.0

ANY_EXIT = "any"         # `expect_exit=ANY_EXIT`: the test checks the daemon's exit status itself
STOP_TIMEOUT_S = 30      # how long a daemon may take to exit after SIGTERM
EVENT_IDLE_S = 5.0       # an event stream quiet this long is reopened (replayed) to look at the clock
LOG_TAIL = 3000


# ------------------------------------------------------------------------- stages


def py_stage(function: str, **extra: Any) -> dict[str, Any]:
    """A `python` stage running a function of tests/fixtures/teststages.py."""
    return python_stage("teststages", function, **extra)


def sleeper(seconds: float, **extra: Any) -> dict[str, Any]:
    """A python stage that works `seconds` per job (teststages.sleep), cancellable."""
    return py_stage("sleep", defaults={"seconds": seconds}, **extra)


def edge(src: str, dst: str, **extra: Any) -> dict[str, Any]:
    """A pipeline's edge from stage `src` to stage `dst`."""
    return {"from": src, "to": dst, **extra}


@pytest.fixture
def models(tmp_path: Path) -> Path:
    """Fake local model directories in tmp_path, next to a config file there (only their marker
    files matter to the config's checks): llm, sd, and an empty one."""
    (tmp_path / "llm").mkdir()
    (tmp_path / "llm" / "config.json").write_text("{}")
    (tmp_path / "sd").mkdir()
    (tmp_path / "sd" / "model_index.json").write_text("{}")
    (tmp_path / "empty").mkdir()
    return tmp_path


def chat_draw_speak() -> tuple[dict[str, Any], dict[str, Any]]:
    """The stages and pipelines of the OpenAI-compatible paths' daemons (test_openai, test_tcp):
    `chat` (the tiny Llama, 12 sampled tokens, the prompt included), `t2i` (its text drawn by the
    tiny SD, 2 steps) and `speak` (its text read by the demo's vocoder, a window of 4 segments)."""
    stages = {
        "expand": tiny_llm({"max_tokens": 12, "temperature": 0.9, "seed": 7, "include_prompt": True},
                           max_model_len=256),
        "draw": tiny_sd({"num_inference_steps": 2, "guidance_scale": 5.0, "seed": 0}),
        "speak": demo_stage("vocoder", defaults={"seconds_per_word": 0.02}),
    }
    pipelines = {
        "chat": {"stages": ["expand"]},
        "t2i": {"stages": ["expand", "draw"],
                "edges": [{"from": "expand", "to": "draw", "window": -1, "map": {"prompt": "text"}}]},
        "speak": {"stages": ["expand", "speak"],
                  "edges": [{"from": "expand", "to": "speak", "window": 4, "map": {"text": "text"}}]},
    }
    return stages, pipelines


# ------------------------------------------------------------------------- daemons


@dataclass
class RunningDaemon:
    proc: subprocess.Popen[bytes]
    dir: Path
    config_path: Path
    socket: Path
    state_dir: Path
    lock_dir: Path
    log_path: Path
    # The exit status teardown expects after its SIGTERM (or that the daemon already exited
    # with): 0 unless a test says otherwise; ANY_EXIT when the test checked it itself.
    expect_exit: int | str = 0
    client: Client = field(init=False)

    def __post_init__(self) -> None:
        self.client = Client(str(self.socket))

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def log_tail(self, n: int = LOG_TAIL) -> str:
        return self.log()[-n:]

    def stages(self) -> dict[str, dict[str, Any]]:
        return {s["name"]: s for s in self.client.stages()["stages"]}

    def stage_pid(self, name: str) -> int:
        pid = self.stages()[name]["pid"]
        assert pid, f"stage {name} has no pid"
        return pid

    def worker_pids(self) -> list[int]:
        try:
            return [c.pid for c in psutil.Process(self.proc.pid).children(recursive=True)]
        except psutil.NoSuchProcess:
            return []

    def kill9(self, timeout: float = 10) -> int:
        """SIGKILL the supervisor itself and reap it; teardown then expects exactly that."""
        self.expect_exit = -signal.SIGKILL
        self.proc.send_signal(signal.SIGKILL)
        return self.proc.wait(timeout)

    def diagnose(self, job: str | None = None) -> str:
        """What the daemon looks like now: alive or its exit status, the job, the stages, its log tail."""
        code = self.proc.poll()
        lines = [f"omnid (pid {self.proc.pid}) " + ("is running" if code is None else f"exited with status {code}")]
        if code is None:
            quick = Client(str(self.socket), timeout=5)
            if job is not None:
                try:
                    doc = quick.job(job)
                    stages = {n: s["state"] for n, s in doc["stages"].items()}
                    lines.append(f"job {job}: {doc['state']}, stages {stages}, error {doc['error']}")
                except (ClientError, OSError) as e:
                    lines.append(f"job {job}: cannot read it ({e})")
            try:
                for snap in quick.stages()["stages"]:
                    lines.append(f"stage {snap['name']}: {snap['state']} pid={snap['pid']} "
                                 f"running={snap['running']} restarts={snap['restarts']} "
                                 f"last_error={snap['last_error']!r}")
            except (ClientError, OSError) as e:
                lines.append(f"stages: cannot read them ({e})")
        lines.append(f"--- tail of {self.log_path}:\n{self.log_tail()}")
        return "\n".join(lines)

    def follow(self, job: str, timeout: float, what: str) -> Iterator[dict[str, Any]]:
        """The job's events, each once, from its start; fail after `timeout` s naming `what`.

        The stream is read with an idle timeout: when it stays quiet, it is opened again (the
        daemon replays it from the start; the events already given are skipped), so the deadline
        is looked at at least every EVENT_IDLE_S seconds even if no event comes.
        """
        deadline = time.monotonic() + timeout
        given = 0
        while True:
            idle = min(EVENT_IDLE_S, max(0.05, deadline - time.monotonic()))
            stream = self.client.events(job, idle_timeout=idle)
            try:
                for index, ev in enumerate(stream):
                    if index < given:
                        continue
                    given += 1
                    yield ev
                    if time.monotonic() > deadline:
                        break
                else:
                    return
            except EventsIdleTimeout:
                pass
            except DaemonUnreachable as e:
                raise AssertionError(f"lost the daemon while waiting for {what} (job {job}): {e}\n"
                                     f"{self.diagnose(job)}") from None
            finally:
                stream.close()
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out after {timeout} s waiting for {what} (job {job}, "
                                     f"{given} events seen)\n{self.diagnose(job)}")

    def submit(self, pipeline: str, inputs: dict[str, Any] | None = None,
               params: dict[str, Any] | None = None, timeout_s: float | None = None) -> str:
        return self.client.submit(pipeline, inputs or {}, params, timeout_s)["id"]

    def wait(self, job: str, timeout: float = 120) -> dict[str, Any]:
        """Follow the job's event stream to its end; return the final job document."""
        for _ in self.follow(job, timeout, f"job {job} to end"):
            pass
        return self.client.job(job)

    def events(self, job: str, timeout: float = 120) -> list[dict[str, Any]]:
        """All the job's events, once it has ended."""
        return list(self.follow(job, timeout, f"the event stream of job {job} to end"))

    def wait_stage_state(self, stage: str, states: tuple[str, ...], timeout: float = 60) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        snap: dict[str, Any] | None = None
        while time.monotonic() < deadline:
            try:
                snap = self.stages()[stage]
            except DaemonUnreachable as e:
                raise AssertionError(f"lost the daemon while waiting for stage {stage} to be in {states}: {e}\n"
                                     f"{self.diagnose()}") from None
            if snap["state"] in states:
                return snap
            time.sleep(0.05)
        raise AssertionError(f"timed out after {timeout} s waiting for stage {stage} to be in {states}; "
                             f"last: {snap}\n{self.diagnose()}")

    def stop(self, timeout: float = STOP_TIMEOUT_S) -> int:
        """SIGTERM, and wait up to `timeout` s; SIGKILL past it. Returns the exit status."""
        if not stop_process(self.proc, timeout):
            raise AssertionError(f"omnid (pid {self.proc.pid}) did not exit within {timeout} s of "
                                 f"SIGTERM; killed it\n--- tail of {self.log_path}:\n{self.log_tail()}")
        return self.proc.returncode


def sigint_default() -> None:
    """`preexec_fn` of every child a test starts: SIGINT at its default. A suite started with SIGINT
    ignored (`nohup make test &`) would pass the ignored signal on, and Python leaves an ignored
    SIGINT ignored: `omnictl watch` and `logs -f` would never stop on the Ctrl-C a test sends."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def omnictl(d: RunningDaemon, *args: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    """Run the real CLI in a subprocess against a daemon; wait for it to exit."""
    return subprocess.run([sys.executable, "-m", "omnictl", "--socket", str(d.socket), *args],
                          capture_output=True, text=True, timeout=timeout, env={**os.environ, "PYTHONPATH": str(ROOT)},
                          preexec_fn=sigint_default)


def interrupt(proc: subprocess.Popen[Any], timeout: float = 10) -> int:
    """Ctrl-C a child (SIGINT) and reap it; SIGKILL past `timeout` s. Returns its exit status."""
    stop_process(proc, timeout, signal.SIGINT)
    return proc.returncode


def metric(d: RunningDaemon, name: str) -> float:
    """One sample of the daemon's /metrics by its full name (labels included), on a fresh connection."""
    from omnictl.client import UnixHTTPConnection

    conn = UnixHTTPConnection(str(d.socket), timeout=10)
    try:
        conn.request("GET", "/metrics")
        text = conn.getresponse().read().decode()
    finally:
        conn.close()
    m = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
    assert m, f"no {name} in /metrics"
    return float(m.group(1))


def wait_gone(pids: list[int], timeout: float = 10) -> list[int]:
    """Wait until none of `pids` is alive (zombies count as gone); return the survivors."""
    deadline = time.monotonic() + timeout
    alive = list(pids)
    while alive and time.monotonic() < deadline:
        alive = [p for p in alive if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
        if alive:
            time.sleep(0.05)
    return alive


TERMINAL = TERMINAL_STATES


def wait_for(cond: Callable[[], Any], timeout: float, what: str, every: float = 0.02) -> Any:
    """Poll `cond` until it returns something truthy; fail naming `what` after `timeout` s."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = cond()
        if value:
            return value
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def wait_end(d: RunningDaemon, job: str, timeout: float = 30) -> dict[str, Any]:
    """Poll the job until it is over (never an unbounded wait on its event stream); its document."""
    return wait_for(lambda: (doc := d.client.job(job))["state"] in TERMINAL and doc, timeout,
                    f"job {job} to end", every=0.05)


def check_config(folder: Path, stages: dict[str, Any], pipelines: dict[str, Any]) -> subprocess.CompletedProcess[str]:
    """`omnid --check` of a config of these stages and pipelines, written into `folder`."""
    path = folder / "omnid.toml"
    path.write_text(toml_dumps({"daemon": {"socket": str(folder / "s.sock"), "state_dir": str(folder / "st")},
                                "stages": stages, "pipelines": pipelines}))
    return subprocess.run([sys.executable, "-m", "omnid", "--check", "-c", str(path)],
                          capture_output=True, text=True, timeout=60, cwd=folder)


@contextmanager
def openai_on_socket(d: RunningDaemon, timeout: float) -> Iterator[Any]:
    """The OpenAI SDK's client of the daemon, over its Unix socket (the test is skipped without
    openai or httpx). No retries: a retried request would be a second job."""
    openai = pytest.importorskip("openai")
    httpx = pytest.importorskip("httpx")
    http = httpx.Client(transport=httpx.HTTPTransport(uds=str(d.socket)), timeout=timeout)
    client = openai.OpenAI(base_url="http://omnid/v1", api_key="unused", http_client=http, max_retries=0)
    try:
        yield client
    finally:
        client.close()
        http.close()


def report_from_a_child(target: Callable[..., None], *args: Any, timeout: float, what: str) -> Any:
    """Run `target(*args, conn)` in a forked child (one that gives up root, say) and return what it
    sends on `conn`; fail if it sends nothing within `timeout` s, naming `what`."""
    import multiprocessing
    ctx = multiprocessing.get_context("fork")
    parent, child = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=target, args=(*args, child))
    proc.start()
    child.close()
    try:
        assert parent.poll(timeout), f"{what} did not report"
        return parent.recv()
    finally:
        proc.join(10)


def run_on_a_pty(cmd: list[str], env: dict[str, str] | None = None, timeout: float = 30) -> tuple[int, str]:
    """Run `cmd` in ROOT with its stdout and stderr on a terminal (a pty); read it until the child
    exits (or `timeout` s). Returns its exit status and all it wrote."""
    import pty
    pid, fd = pty.fork()
    if pid == 0:                                   # the child: stdout and stderr are the terminal
        os.chdir(ROOT)
        if env is not None:
            os.environ.update(env)
        os.execv(cmd[0], cmd)
    output = b""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            data = os.read(fd, 4096)
        except OSError:
            break
        if not data:
            break
        output += data
    os.close(fd)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status), output.decode(errors="replace")


def wait_started(d: RunningDaemon, job: str, stage: str, timeout: float = 60) -> float:
    """Follow the job's events until `stage` starts it; return when that was seen."""
    for ev in d.follow(job, timeout, f"stage {stage} to start job {job}"):
        if ev["type"] == "stage_started" and ev["stage"] == stage:
            return time.monotonic()
        if ev["type"] == "state" and ev["state"] in TERMINAL:
            raise AssertionError(f"job {job} ended ({ev}) before stage {stage} started it")
    raise AssertionError(f"the event stream of job {job} ended before stage {stage} started it")


def short_tmpdir() -> Path:
    """A short directory (Unix socket paths are limited to 107 bytes)."""
    return Path(tempfile.mkdtemp(prefix="omnid-t-", dir="/tmp"))


def daemon_config(d: Path, stages: dict[str, Any], pipelines: dict[str, Any],
                  daemon: dict[str, Any] | None = None) -> Path:
    cfg = {"daemon": {"socket": str(d / "omnid.sock"), "state_dir": str(d / "state"),
                      "lock_dir": str(d / "lock"), "heartbeat_interval_s": 0.2,
                      # tests stop daemons with jobs still running: no drain wait unless a test asks
                      "restart_backoff_s": 0.2, "drain_timeout_s": 0, "log_level": "debug", **(daemon or {})},
           "stages": stages, "pipelines": pipelines}
    path = d / "omnid.toml"
    path.write_text(toml_dumps(cfg))
    return path


def launch(config_path: Path, log_path: Path, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    with open(log_path, "ab") as log:
        return subprocess.Popen([sys.executable, "-m", "omnid", "-c", str(config_path)], stdout=log,
                                stderr=subprocess.STDOUT, env=full_env, cwd=str(config_path.parent),
                                preexec_fn=sigint_default)


def wait_ready(d: RunningDaemon, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    probe = Client(str(d.socket), timeout=5)
    last: Any = "no answer yet"
    while time.monotonic() < deadline:
        if d.proc.poll() is not None:
            raise RuntimeError(f"omnid exited with {d.proc.returncode} before it was ready:\n{d.log()[-6000:]}")
        try:
            ok, body = probe.ready()
            if ok:
                return
            last = body
        except (OSError, ClientError) as e:
            last = e
        time.sleep(0.1)
    raise TimeoutError(f"omnid not ready after {timeout} s (last /v1/ready: {last}):\n{d.log()[-6000:]}")


def stop_and_check(rd: RunningDaemon) -> list[str]:
    """Teardown of one daemon: SIGTERM, its exit status as expected, no worker left. Returns problems."""
    problems: list[str] = []
    workers = rd.worker_pids()
    try:
        code = rd.stop()
    except AssertionError as e:
        problems.append(f"{rd.config_path}: {e}")
        code = None
    if code is not None and rd.expect_exit != ANY_EXIT and code != rd.expect_exit:
        problems.append(f"{rd.config_path}: omnid exited with status {code}, expected {rd.expect_exit}\n"
                        f"--- tail of {rd.log_path}:\n{rd.log_tail()}")
    survivors = wait_gone(workers)
    if survivors:
        problems.append(f"{rd.config_path}: workers {survivors} outlived the daemon: " + "; ".join(" ".join(psutil.Process(p).cmdline())[:160] for p in survivors if psutil.pid_exists(p)))
        for p in survivors:
            try:
                os.kill(p, signal.SIGKILL)
            except ProcessLookupError:
                pass
    return problems


@contextmanager
def module_daemon(d: Path, stages: dict[str, Any], pipelines: dict[str, Any], daemon: dict[str, Any] | None = None,
                  *, ready_timeout: float = 300, forbid_in_log: tuple[str, ...] = ()) -> Iterator[RunningDaemon]:
    """A daemon that a module-scoped fixture shares among its tests (it yields from this): started
    in `d` and ready; at the end stopped and checked as `start_daemon` checks its own (and its log
    holds none of `forbid_in_log`), and `d` removed."""
    cfg = daemon_config(d, stages, pipelines, daemon)
    rd = RunningDaemon(launch(cfg, d / "omnid.log"), d, cfg, d / "omnid.sock", d / "state", d / "lock",
                       d / "omnid.log")
    try:
        wait_ready(rd, timeout=ready_timeout)
        yield rd
    finally:
        problems = stop_and_check(rd)
        log = rd.log()
        shutil.rmtree(d, ignore_errors=True)
        assert not problems, "\n".join(problems)
        for words in forbid_in_log:
            assert words not in log, f"{words!r} in the daemon's log:\n{log[-LOG_TAIL:]}"


@pytest.fixture
def start_daemon() -> Iterator[Callable[..., RunningDaemon]]:
    started: list[RunningDaemon] = []
    dirs: list[Path] = []

    def start(stages: dict[str, Any], pipelines: dict[str, Any], daemon: dict[str, Any] | None = None,
              *, wait: bool = True, dir: Path | None = None, env: dict[str, str] | None = None,
              expect_exit: int | str = 0) -> RunningDaemon:
        """`expect_exit`: the exit status teardown expects (ANY_EXIT: the test checks it)."""
        d = dir or short_tmpdir()
        dirs.append(d)
        config_path = daemon_config(d, stages, pipelines, daemon)
        cfg_daemon = {"socket": d / "omnid.sock", "state_dir": d / "state", "lock_dir": d / "lock",
                      **{k: Path(v) for k, v in (daemon or {}).items() if k in ("socket", "state_dir", "lock_dir")}}
        log_path = d / f"omnid-{len(started)}.log"
        proc = launch(config_path, log_path, env)
        rd = RunningDaemon(proc, d, config_path, cfg_daemon["socket"], cfg_daemon["state_dir"],
                           cfg_daemon["lock_dir"], log_path, expect_exit)
        started.append(rd)
        if wait:
            wait_ready(rd)
        return rd

    yield start
    problems: list[str] = []
    for rd in started:
        problems += stop_and_check(rd)
    for d in dirs:
        shutil.rmtree(d, ignore_errors=True)
    assert not problems, "\n".join(problems)


# ------------------------------------------------------------------------- descriptors under a watch


def watch_descriptors(watcher: int, child: int) -> list[int]:
    """The descriptors by which process `watcher` watches its child: pidfds, and pipe read ends
    whose other end the child holds (multiprocessing's sentinel)."""
    def fds(pid: int) -> dict[int, str]:
        out = {}
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                out[int(fd)] = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                pass
        return out
    child_pipes = {target for target in fds(child).values() if target.startswith("pipe:")}
    found = []
    for fd, target in fds(watcher).items():
        if target == "anon_inode:[pidfd]":
            found.append(fd)
        elif target in child_pipes:
            with open(f"/proc/{watcher}/fdinfo/{fd}") as f:
                flags = int(next(line for line in f if line.startswith("flags:")).split()[1], 8)
            if flags & 0o3 == os.O_RDONLY:
                found.append(fd)
    return sorted(found)


def close_in(pid: int, fds: list[int], keep_numbers: bool = False) -> None:
    """Close descriptors inside a live process (ptrace: tests/inject.py), as a double close in its
    own code would. `keep_numbers`: put /dev/null in their place instead (the file goes, the number
    stays taken: an event loop's own map of descriptors stays true)."""
    if keep_numbers:
        (null,) = inject.syscalls(pid, [(inject.SYS_OPENAT, inject.AT_FDCWD, ("str", 0), os.O_RDONLY)],
                                  strings=(b"/dev/null",))
        assert null >= 0, f"open(/dev/null) in {pid}: {os.strerror(-null)}"
        results = inject.syscalls(pid, [*((inject.SYS_DUP2, null, fd) for fd in fds), (inject.SYS_CLOSE, null)])
    else:
        results = inject.syscalls(pid, [(inject.SYS_CLOSE, fd) for fd in fds])
    assert all(r >= 0 for r in results), (pid, fds, results)


# ------------------------------------------------------------------------- the longest files first

# `make test` runs the files on pytest-xdist workers, a file to a worker, in the order collected:
# the files that take longest (measured: a 3-worker run on 2 cores from a fresh clone, 2026-12) go first, so
# that no worker starts one of them when the others are nearly done. The rest follow as collected.
LONGEST_FIRST = (
    "tests/test_vllm_compile.py", "tests/test_engine_core.py", "tests/test_omni_pipeline.py", "tests/test_realtime.py",
    "tests/test_docs_tour.py",
    "tests/test_engines.py", "tests/test_priorities.py", "tests/test_lora.py", "tests/test_tracing.py",
    "tests/test_omni_speech.py", "tests/test_systemd.py", "tests/test_shm.py", "tests/test_vllm_tensors.py",
    "tests/test_ray.py", "tests/test_gpucheck.py", "tests/test_startup.py", "tests/test_streaming.py",
    "tests/test_openai.py", "tests/test_tcp.py", "tests/test_multimodal.py", "tests/test_jobs.py",
    "tests/test_restarts.py", "tests/test_omni_model.py", "tests/test_diffusers_batching.py", "tests/test_hangups.py",
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(rank)))     # (stable: a file's own order kept)


# ------------------------------------------------------------------------- nothing outlives the suite


# multiprocessing's helpers of this process itself (a test that used shared memory or spawn here):
# each reads a pipe this process holds and ends when it exits, after the session's end.
_OWN_HELPERS = ("multiprocessing.resource_tracker", "multiprocessing.forkserver")


def session_processes() -> list[psutil.Process]:
    """The live processes that carry this session's mark (but this one and its own helpers)."""
    mark = os.environ[SESSION_MARK]
    found = []
    for p in psutil.process_iter():
        if p.pid == os.getpid():
            continue
        try:
            if p.status() == psutil.STATUS_ZOMBIE or p.environ().get(SESSION_MARK) != mark:
                continue
            if p.ppid() == os.getpid() and any(h in " ".join(p.cmdline()) for h in _OWN_HELPERS):
                continue
            found.append(p)
        except psutil.Error:
            continue
    return found


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """The suite cleans up after itself: what it started and left running is named, killed, and
    fails the run."""
    deadline = time.monotonic() + LEFTOVER_GRACE_S
    left = session_processes()
    while left and time.monotonic() < deadline:     # (a teardown's SIGTERM still taking effect)
        time.sleep(0.2)
        left = session_processes()
    if not left:
        return
    lines = []
    for p in left:
        try:
            lines.append(f"  pid {p.pid}: {' '.join(p.cmdline())[:300]}")
        except psutil.Error:
            lines.append(f"  pid {p.pid}")
        try:
            p.kill()
        except psutil.Error:
            pass
    report = f"{len(left)} process(es) started by the suite outlived it (now killed):\n" + "\n".join(lines)
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.write_sep("=", "left running", red=True)
        reporter.write_line(report)
    else:
        print(report, file=sys.stderr)
    session.exitstatus = pytest.ExitCode.TESTS_FAILED
