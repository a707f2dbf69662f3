"""SIGHUP reloads the config without a restart; `omnictl stage restart` replaces one worker.

Real daemons; the config file is rewritten and the daemon sent a real SIGHUP.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import pytest
from conftest import ROOT, RunningDaemon, daemon_config, py_stage, sleeper, wait_for, wait_started

from omnictl.client import ApiError, Client

Start = Callable[..., RunningDaemon]


def rewrite(d: RunningDaemon, stages: dict[str, Any], pipelines: dict[str, Any],
            daemon: dict[str, Any] | None = None) -> None:
    daemon_config(d.dir, stages, pipelines, daemon)


def sighup(d: RunningDaemon, expect: str) -> None:
    """Send SIGHUP and wait for the daemon to log `expect` ("reloaded" or "reload refused...")."""
    before = d.log().count(expect)
    d.proc.send_signal(signal.SIGHUP)
    wait_for(lambda: d.log().count(expect) > before, 60, f"{expect!r} in the daemon's log")


def pids(d: RunningDaemon) -> dict[str, int]:
    return {name: s["pid"] for name, s in d.stages().items()}


def test_a_broken_config_is_refused_and_the_old_one_keeps_serving(start_daemon: Start) -> None:
    stages, pipelines = {"a": py_stage("echo")}, {"p": {"stages": ["a"]}}
    d = start_daemon(stages, pipelines)
    before = pids(d)
    d.config_path.write_text(d.config_path.read_text() + "\n[stages.b]\nengine = 'onnx'\n")
    sighup(d, "reload refused: the config is invalid")
    assert "stages.b.engine" in d.log()                      # the same report as --check
    # `omnictl reload` is refused the same way: exit 4 (the daemon refused), its status line on stderr
    r = subprocess.run([sys.executable, "-m", "omnictl", "--socket", str(d.socket), "reload"], capture_output=True,
                       text=True, timeout=60, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 4, (r.returncode, r.stdout, r.stderr)
    assert r.stderr.startswith("omnictl: reload refused: 1 problem(s)"), r.stderr
    assert d.wait(d.submit("p", {"text": "still"}))["state"] == "succeeded"
    assert pids(d) == before
    # and what only a restart can change is refused too
    rewrite(d, stages, pipelines, {"state_dir": str(d.dir / "elsewhere")})
    sighup(d, "reload refused: only a restart can change these")
    assert d.wait(d.submit("p", {"text": "again"}))["state"] == "succeeded"


def test_a_reload_adds_a_pipeline_and_restarts_only_the_changed_stage(start_daemon: Start) -> None:
    stages = {"a": py_stage("echo", defaults={"tag": "one"}), "b": py_stage("echo"), "c": py_stage("echo")}
    pipelines = {"p": {"stages": ["a", "b"]}, "q": {"stages": ["c"]}}
    d = start_daemon(stages, pipelines)
    before = pids(d)
    stages["a"] = py_stage("echo", defaults={"tag": "two"})          # changed
    stages["new"] = py_stage("echo", defaults={"tag": "fresh"})      # added
    pipelines["r"] = {"stages": ["new", "c"]}                        # added, sharing c
    rewrite(d, stages, pipelines)
    sighup(d, "reloaded")
    after = pids(d)
    assert after["b"] == before["b"] and after["c"] == before["c"]   # untouched: same warm workers
    assert after["a"] != before["a"] and after["new"]
    end = d.wait(d.submit("p", {"text": "x"}))
    assert d.client.output(end["id"], "text")[0].decode() == "echo:two:x"   # the new defaults
    end = d.wait(d.submit("r", {"text": "y"}))
    assert end["state"] == "succeeded"
    assert d.client.output(end["id"], "text")[0].decode() == "echo:fresh:y"
    assert {p["name"] for p in d.client.pipelines()["pipelines"]} == {"p", "q", "r"}


def test_a_job_in_flight_finishes_on_the_definition_it_started_with(start_daemon: Start) -> None:
    stages = {"slow": sleeper(1.5), "b": py_stage("echo", defaults={"tag": "b"}),
              "c": py_stage("echo", defaults={"tag": "c"})}
    d = start_daemon(stages, {"p": {"stages": ["slow", "b"]}})
    old = d.submit("p", {"text": "old"})
    wait_started(d, old, "slow")
    rewrite(d, stages, {"p": {"stages": ["slow", "c"]}})             # the pipeline now ends in c
    sighup(d, "reloaded")
    new = d.submit("p", {"text": "new"})
    assert d.client.output(d.wait(old)["id"], "text")[0].decode() == "b:old|slow"
    assert d.client.output(d.wait(new)["id"], "text")[0].decode() == "c:new|slow"


def test_a_removed_stage_finishes_its_job_then_stops(start_daemon: Start) -> None:
    stages = {"keep": py_stage("echo"), "gone": sleeper(1.5)}
    d = start_daemon(stages, {"p": {"stages": ["keep"]}, "g": {"stages": ["gone"]}})
    job = d.submit("g", {"text": "last"})
    wait_started(d, job, "gone")
    gone_pid = d.stage_pid("gone")
    rewrite(d, {"keep": stages["keep"]}, {"p": {"stages": ["keep"]}})
    sighup(d, "reloaded")
    with pytest.raises(ApiError) as refused:
        d.submit("g", {"text": "too late"})
    assert refused.value.code == "unknown_pipeline"
    assert d.wait(job)["state"] == "succeeded"                       # finished on the old stage
    wait_for(lambda: "gone" not in d.stages(), 20, "the removed stage to stop")
    wait_for(lambda: not _alive(gone_pid), 10, "its worker to exit")


def _as_nobody(call: Callable[[], Any]) -> tuple[int, str]:
    """Run `call` in a child process as uid/gid 65534; the (status, code) of the ApiError it got."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:                                       # the child: no file access needed, all imported
        os.close(read)
        answer = b"0 none"
        try:
            os.setgroups([])
            os.setgid(65534)
            os.setuid(65534)
            call()
        except ApiError as e:
            answer = f"{e.status} {e.code}".encode()
        except BaseException as e:
            answer = f"0 {type(e).__name__}".encode()
        os.write(write, answer)
        os._exit(0)
    os.close(write)
    os.waitpid(pid, 0)
    status, code = os.read(read, 200).decode().split(" ", 1)
    os.close(read)
    return int(status), code


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_an_admins_restart_stops_the_worker_gently_and_is_no_error(start_daemon: Start) -> None:
    """`omnictl stage restart` of an idle stage: the worker is asked to stop and exits by itself (status
    0, no SIGKILL), the daemon logs a restart (info), not a death, and `omnictl stages` shows a restart
    and no last error."""
    d = start_daemon({"a": py_stage("echo")}, {"p": {"stages": ["a"]}})
    old = d.stage_pid("a")
    omnictl = [sys.executable, "-m", "omnictl", "--socket", str(d.socket)]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    r = subprocess.run([*omnictl, "stage", "restart", "a"], capture_output=True, text=True, timeout=60, env=env)
    assert r.returncode == 0 and "a: ready" in r.stdout, (r.stdout, r.stderr)
    assert d.stage_pid("a") != old
    log = d.log()
    assert "stage worker died" not in log and "killing stage worker" not in log, log[-3000:]
    [stopped] = [json.loads(line) for line in log.splitlines() if "stage worker stopped for a restart" in line]
    assert (stopped["level"], stopped["pid"], stopped["exit"]) == ("info", old, 0), stopped
    assert stopped["reason"].startswith("asked for by uid"), stopped
    shown = subprocess.run([*omnictl, "--json", "stages"], capture_output=True, text=True, timeout=30, env=env)
    [a] = json.loads(shown.stdout)["stages"]
    assert a["last_error"] is None and a["restarts"] == 1, a
    assert a["last_restart"]["reason"].startswith("asked for by uid"), a
    table = subprocess.run([*omnictl, "stages"], capture_output=True, text=True, timeout=30, env=env).stdout
    assert "died" not in table and "killed" not in table, table
    assert d.wait(d.submit("p", {"text": "after"}))["state"] == "succeeded"


def test_stage_restart_replaces_a_worker_and_revives_a_failed_stage(start_daemon: Start) -> None:
    d = start_daemon({"a": py_stage("echo"), "b": py_stage("echo")}, {"p": {"stages": ["a", "b"]}},
                     {"max_restarts": 0, "socket_mode": "0666"})
    old_a, old_b = d.stage_pid("a"), d.stage_pid("b")
    omnictl = [sys.executable, "-m", "omnictl", "--socket", str(d.socket)]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    r = subprocess.run([*omnictl, "stage", "restart", "a"], capture_output=True, text=True, timeout=60, env=env)
    assert r.returncode == 0, r.stderr
    assert "a: ready" in r.stdout
    assert d.stage_pid("a") != old_a and d.stage_pid("b") == old_b
    # A stage given up after crashing (max_restarts = 0: the first crash) comes back on request.
    os.kill(old_b, signal.SIGKILL)
    d.wait_stage_state("b", ("failed",))
    with pytest.raises(ApiError) as refused:
        d.submit("p", {"text": "x"})
    assert refused.value.code == "stage_failed"
    r = subprocess.run([*omnictl, "stage", "restart", "b"], capture_output=True, text=True, timeout=60, env=env)
    assert r.returncode == 0, r.stderr
    assert d.wait(d.submit("p", {"text": "back"}))["state"] == "succeeded"
    # Not root, not in the admin group: 403 not_admin (a forked client as uid 65534).
    os.chmod(d.dir, 0o711)                             # (mkdtemp made it 0700): nobody may reach the socket
    assert _as_nobody(lambda: Client(str(d.socket)).restart_stage("a")) == (403, "not_admin")
    unknown = Client(str(d.socket))
    with pytest.raises(ApiError) as nothing:
        unknown.restart_stage("nope")
    assert nothing.value.status == 404 and nothing.value.code == "unknown_stage"
