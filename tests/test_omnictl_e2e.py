"""The real `omnictl`, in its own process, against a real omnid: outputs, JSON and every exit code.

tests/omnictl/ checks the CLI against a fake daemon; this file checks that the two real programs
agree. Three tests start one daemon each (`start_daemon` is per test; python stages of
tests/fixtures/teststages.py, about a second to start), two need none. Every test runs
`python -m omnictl --socket ...` as a subprocess, the way a user or a script does, then checks the
exit code, stdout and stderr, and the files it wrote, against the daemon's own API
(`omnictl.client.Client`) and against the bytes the stage functions produce.

Everything blocks on subprocesses with a timeout, or on a job's event stream; no fixed sleeps.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import signal
import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from conftest import FIXTURES, ROOT, RunningDaemon, py_stage, sigint_default, sleeper, wait_started

from omnid.vocabulary import ErrorCode, EventType, JobState

# The stage functions themselves, for the bytes they produce (loaded without touching sys.path).
_spec = importlib.util.spec_from_file_location("_e2e_teststages", FIXTURES / "teststages.py")
assert _spec is not None and _spec.loader is not None
teststages = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(teststages)

STAGES = {
    "a": py_stage("echo", defaults={"tag": "a"}),
    "b": py_stage("echo", defaults={"tag": "b"}),
    "media": py_stage("files"),
    "broken": py_stage("fail"),
    "slow": sleeper(30),
    "copy": py_stage("passthrough"),
}
PIPELINES = {
    "chain": {"stages": ["a", "b"]},          # text through two stages: "b:a:<prompt>"
    "media": {"stages": ["media"]},           # one output of each kind, fixed bytes
    "broken": {"stages": ["a", "broken"]},    # the second stage raises
    "slow": {"stages": ["slow"]},             # works 30 s unless cancelled
    "copy": {"stages": ["copy"]},             # its inputs back as outputs
}
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
ENV.pop("OMNID_SOCKET", None)
REFUSAL_LINE = re.compile(r"^omnictl: (?:\S+: )?.+ \((\w+)\)$")


def start(start_daemon: Callable[..., RunningDaemon]) -> RunningDaemon:
    return start_daemon(STAGES, PIPELINES)


def omnictl(where: RunningDaemon | Path, *args: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    """Run the real CLI in a subprocess against a daemon (or a socket path); wait for it to exit."""
    path = where.socket if isinstance(where, RunningDaemon) else where
    return subprocess.run([sys.executable, "-m", "omnictl", "--socket", str(path), *args], env=ENV,
                          capture_output=True, text=True, timeout=timeout, cwd=ROOT, preexec_fn=sigint_default)


def popen_omnictl(d: RunningDaemon, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "omnictl", "--socket", str(d.socket), *args], env=ENV,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                            preexec_fn=sigint_default)


def refused_code(result: subprocess.CompletedProcess[str]) -> str:
    """The error code of a refusal (exit 4): its last stderr line is `omnictl: <message> (<code>)`."""
    assert result.returncode == 4, result
    assert result.stdout == "", result
    match = REFUSAL_LINE.match(result.stderr.splitlines()[-1])
    assert match, result.stderr
    return match.group(1)


def files_in(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def ndjson(text: str) -> list[dict]:
    return [json.loads(line) for line in text.splitlines()]


# ------------------------------------------------------------------ exit 0: a job that succeeds


def test_submit_wait_result_status_watch_rm(start_daemon: Callable[..., RunningDaemon], tmp_path: Path) -> None:
    d = start(start_daemon)

    # submit --wait -o DIR: the id first, then each file written, then the final state; exit 0.
    out = tmp_path / "out"
    r = omnictl(d, "submit", "chain", "--prompt", "a red fox", "--wait", "-o", str(out))
    assert r.returncode == 0, r
    lines = r.stdout.splitlines()
    job = lines[0]
    doc = d.client.job(job)
    assert doc["state"] == JobState.SUCCEEDED
    assert files_in(out) == {"text.txt": b"b:a:a red fox", "pid.json": str(d.stage_pid("b")).encode()}
    assert lines[1:-1] == [str(out / o["file"]) for o in doc["outputs"]]
    assert re.fullmatch(rf"{job} succeeded in \S+", lines[-1]), lines[-1]
    assert "a: started" in r.stderr and "b: started" in r.stderr     # progress goes to stderr

    # result JOB -o DIR writes the same files, and lists them.
    again = tmp_path / "again"
    r = omnictl(d, "result", job, "-o", str(again))
    assert r.returncode == 0, r
    assert files_in(again) == files_in(out)
    assert r.stdout.splitlines()[:-1] == [str(again / o["file"]) for o in doc["outputs"]]

    # status JOB --json is exactly the API's document; so is the one a unique prefix names.
    for ref, args in ((job, ["status", job, "--json"]), (job[:4], ["--json", "status", job[:4]])):
        r = omnictl(d, *args)
        assert r.returncode == 0, (ref, r)
        assert json.loads(r.stdout) == d.client.job(job)
    r = omnictl(d, "status", job)
    assert r.returncode == 0 and r.stderr == "" and "chain" in r.stdout and "a red fox" in r.stdout, r

    # status: the table of recent jobs lists it; --json is the API's listing.
    r = omnictl(d, "status")
    assert r.returncode == 0, r
    assert r.stdout.splitlines()[0].split()[:3] == ["ID", "PIPELINE", "STATE"]
    [row] = [line for line in r.stdout.splitlines() if line.startswith(job)]
    assert row.split()[1:3] == ["chain", "succeeded"]
    r = omnictl(d, "status", "--json", "--state", "succeeded", "--pipeline", "chain")
    assert r.returncode == 0 and json.loads(r.stdout) == d.client.jobs("succeeded", "chain", 20)

    # watch --json of a finished job: NDJSON, the job's whole event stream, in the vocabulary.
    r = omnictl(d, "watch", job, "--json")
    assert r.returncode == 0, r
    events = ndjson(r.stdout)
    assert events == d.events(job)
    assert {e["type"] for e in events} <= set(EventType)
    assert [e["name"] for e in events if e["type"] == EventType.OUTPUT] == ["text", "pid"]
    assert (events[-1]["type"], events[-1]["state"]) == (EventType.STATE, JobState.SUCCEEDED)
    r = omnictl(d, "watch", job)
    assert r.returncode == 0 and r.stdout.splitlines()[-1].startswith(f"{job} succeeded"), r

    # Binary outputs come through byte for byte.
    media = tmp_path / "media"
    r = omnictl(d, "submit", "media", "--wait", "-o", str(media))
    assert r.returncode == 0, r
    got = files_in(media)
    assert set(got) == {"text.txt", "picture.png", "sound.wav", "meta.json"}
    assert got["text.txt"] == b"hello"
    assert got["picture.png"] == teststages.tiny_png()
    assert got["sound.wav"] == teststages.tiny_wav()
    assert json.loads(got["meta.json"]) == {"n": 3, "ok": True}

    # --file and --input reach the stage: a file comes back byte for byte, an --input as a string.
    picture = tmp_path / "in.png"
    picture.write_bytes(teststages.tiny_png())
    copied = tmp_path / "copied"
    r = omnictl(d, "submit", "copy", "--file", f"image={picture}", "--input", "seed=42", "--wait", "-o", str(copied))
    assert r.returncode == 0, r
    assert files_in(copied) == {"image.png": teststages.tiny_png(), "seed.txt": b"42"}

    # --json submit --wait prints the job's events as NDJSON, nothing else, and still writes the files.
    quiet = tmp_path / "quiet"
    r = omnictl(d, "--json", "submit", "chain", "--prompt", "fox", "--wait", "-o", str(quiet))
    assert r.returncode == 0, r
    events = ndjson(r.stdout)
    assert events == d.events(events[0]["job"])
    assert files_in(quiet)["text.txt"] == b"b:a:fox"

    # rm forgets it: then the daemon refuses it (404 unknown_job), for status and result alike.
    r = omnictl(d, "rm", job)
    assert (r.returncode, r.stdout) == (0, f"{job}\n"), r
    assert refused_code(omnictl(d, "status", job)) == ErrorCode.UNKNOWN_JOB
    assert refused_code(omnictl(d, "result", job, "-o", str(tmp_path / "gone"))) == ErrorCode.UNKNOWN_JOB


# ------------------------------------------------------------------ exit 1: failed, cancelled, timed out


def test_failed_cancelled_and_timed_out_jobs_exit_1(start_daemon: Callable[..., RunningDaemon], tmp_path: Path) -> None:
    d = start(start_daemon)

    # A stage that raises: the job fails, submit --wait exits 1 and ends with the error.
    out = tmp_path / "out"
    r = omnictl(d, "submit", "broken", "--prompt", "x", "--param", "broken.message=boom 42", "--wait", "-o", str(out))
    assert r.returncode == 1, r
    job = r.stdout.splitlines()[0]
    doc = d.client.job(job)
    assert doc["state"] == JobState.FAILED
    assert doc["error"]["code"] in set(ErrorCode)
    assert "boom 42" in doc["error"]["message"]          # --param reached the stage
    last = r.stdout.splitlines()[-1]
    assert last.startswith(f"{job} failed after ") and "boom 42" in last and f"({doc['error']['code']})" in last
    assert "broken: error: " in r.stderr
    assert not out.exists() or not any(out.iterdir())            # a failed sink wrote nothing

    # watch and result say the same by their exit code; status succeeds whatever the job's state.
    r = omnictl(d, "watch", job)
    assert r.returncode == 1 and r.stdout.splitlines()[-1] == last, r
    assert omnictl(d, "result", job, "-o", str(tmp_path / "r")).returncode == 1
    r = omnictl(d, "status", job)
    assert r.returncode == 0 and "failed" in r.stdout and "boom 42" in r.stdout, r

    # A slow job, followed by submit --wait in one process and cancelled from another.
    waiting = popen_omnictl(d, "submit", "slow", "--prompt", "x", "--wait", "-o", str(tmp_path / "slow"))
    try:
        assert waiting.stdout is not None
        job = waiting.stdout.readline().strip()       # the id comes first, before the job ends
        wait_started(d, job, "slow")

        # Ctrl-C stops following a job (130), not the job.
        watcher = popen_omnictl(d, "watch", job, "--json")
        assert watcher.stdout is not None
        assert json.loads(watcher.stdout.readline())["job"] == job      # it is following now
        watcher.send_signal(signal.SIGINT)
        _, err = watcher.communicate(timeout=10)
        assert watcher.returncode == 130, err
        assert "Traceback" not in err, err
        # said as submit --wait says it: the job goes on, and how to stop it
        assert err == f"omnictl: stopped watching; job {job} keeps running (`omnictl cancel {job}` stops it)\n", err
        assert d.client.job(job)["state"] == JobState.RUNNING

        # While it runs, the daemon refuses to forget it, and result refuses to write it.
        assert refused_code(omnictl(d, "rm", job)) == ErrorCode.JOB_NOT_FINISHED
        assert refused_code(omnictl(d, "result", job)) == ErrorCode.JOB_NOT_FINISHED

        # Cancelled from another process: that one exits 0, the waiting one 1.
        r = omnictl(d, "cancel", job)
        assert (r.returncode, r.stdout) == (0, f"{job} {JobState.CANCELLED}\n"), r
        rest, err = waiting.communicate(timeout=20)
    finally:
        if waiting.poll() is None:
            waiting.kill()
            waiting.communicate()
    assert waiting.returncode == 1, (rest, err)
    assert rest.splitlines()[-1].startswith(f"{job} cancelled after "), rest
    assert f"({ErrorCode.CANCELLED})" in rest.splitlines()[-1]
    assert d.client.job(job)["state"] == JobState.CANCELLED
    r = omnictl(d, "cancel", job, "--json")                       # idempotent
    assert r.returncode == 0 and json.loads(r.stdout)["state"] == JobState.CANCELLED, r
    # Several ids with --json: one document, an array in their order, a refused one with its error.
    r = omnictl(d, "--json", "cancel", job, "nosuchjob")
    both = json.loads(r.stdout)
    assert r.returncode == 4 and [x.get("state") for x in both] == [JobState.CANCELLED, None], r
    assert both[1] == {"id": "nosuchjob", "error": {"code": ErrorCode.UNKNOWN_JOB, "message": both[1]["error"]["message"]}}
    assert omnictl(d, "rm", job).returncode == 0

    # A job over its --timeout.
    r = omnictl(d, "submit", "slow", "--timeout", "0.3", "--wait", "-o", str(tmp_path / "late"))
    assert r.returncode == 1, r
    job = r.stdout.splitlines()[0]
    assert d.client.job(job)["state"] == JobState.TIMED_OUT
    assert r.stdout.splitlines()[-1].startswith(f"{job} timed_out after "), r


# ------------------------------------------------------------------ exit 2 and 3: no daemon needed


def test_usage_errors_exit_2_before_dialing(tmp_path: Path) -> None:
    # No daemon at this path: a usage error must be found first (2), not the missing daemon (3).
    nowhere = tmp_path / "omnid.sock"
    for args in (
        ["submit", "chain", "--param", "steps=20"],           # no STAGE.
        ["submit", "chain", "--param", "a.steps"],            # no =VALUE
        ["submit", "chain", "--input", "prompt"],
        ["submit", "chain", "--frobnicate"],                  # unknown option
        ["--frobnicate", "status"],
        ["frobnicate"],                                       # unknown command
        ["status", "--state", "done"],                        # not a job state
        ["submit", "chain", "-o", str(tmp_path)],             # -o without --wait
        ["watch"],                                            # missing JOB
    ):
        r = omnictl(nowhere, *args)
        assert r.returncode == 2, (args, r)
        assert r.stdout == "" and "Error" in r.stderr, (args, r)


def test_unreachable_daemon_exits_3(tmp_path: Path) -> None:
    nowhere = tmp_path / "omnid.sock"
    for args in (["status"], ["health"], ["submit", "chain", "--prompt", "x", "--wait"], ["watch", "abcd"]):
        r = omnictl(nowhere, *args)
        assert r.returncode == 3, (args, r)
        assert r.stdout == "" and str(nowhere) in r.stderr, (args, r)
    # A socket file nobody listens on (a daemon that died uncleanly) is unreachable too.
    stale = tmp_path / "stale.sock"
    with socket.socket(socket.AF_UNIX) as bound:
        bound.bind(str(stale))
        r = omnictl(stale, "stages")
    assert r.returncode == 3 and str(stale) in r.stderr, r


# ------------------------------------------------------------------ a fresh daemon: inspection, and exit 4


def test_inspection_commands_and_refusals_exit_4(start_daemon: Callable[..., RunningDaemon]) -> None:
    d = start(start_daemon)
    check_inspection_commands(d)

    # The daemon refuses: exit 4, `omnictl: <message> (<code>)` on stderr, nothing on stdout.
    r = omnictl(d, "submit", "nope", "--prompt", "x")
    assert refused_code(r) == ErrorCode.UNKNOWN_PIPELINE
    assert "no pipeline 'nope'" in r.stderr and "chain" in r.stderr, r
    assert refused_code(omnictl(d, "submit", "chain", "--param", "nostage.k=1")) == ErrorCode.INVALID_PARAM
    assert d.client.jobs()["jobs"] == []                          # none of that made a job

    r = omnictl(d, "submit", "chain", "--prompt", "x")
    assert r.returncode == 0, r
    job = r.stdout.strip()                                       # the id alone
    d.wait(job)
    assert refused_code(omnictl(d, "status", "deadbeef0000")) == ErrorCode.UNKNOWN_JOB
    assert refused_code(omnictl(d, "status", job[:3])) == ErrorCode.UNKNOWN_JOB     # prefixes need 4
    assert omnictl(d, "status", job[:4]).returncode == 0
    assert refused_code(omnictl(d, "watch", "deadbeef0000")) == ErrorCode.UNKNOWN_JOB
    assert refused_code(omnictl(d, "rm", "deadbeef0000")) == ErrorCode.UNKNOWN_JOB

    # Several jobs: each refusal is reported, the others still done; exit 4 for the refusal.
    r = omnictl(d, "cancel", job, "deadbeef0000")
    assert r.returncode == 4, r
    assert r.stdout == f"{job} succeeded\n"
    assert r.stderr == "omnictl: deadbeef0000: no job 'deadbeef0000' (unknown_job)\n"


def check_inspection_commands(d: RunningDaemon) -> None:
    """stages, pipelines, health and metrics exit 0 and show what the API says."""
    r = omnictl(d, "stages")
    assert r.returncode == 0, r
    rows = {line.split()[0]: line.split() for line in r.stdout.splitlines()[1:]}
    assert set(rows) == set(STAGES)
    assert all(row[1:3] == ["python", "ready"] for row in rows.values()), r.stdout
    assert rows["b"][3] == str(d.stage_pid("b"))
    r = omnictl(d, "stages", "--json")
    assert r.returncode == 0, r
    assert [(s["name"], s["pid"]) for s in json.loads(r.stdout)["stages"]] == \
        [(s["name"], s["pid"]) for s in d.client.stages()["stages"]]

    r = omnictl(d, "pipelines")
    assert r.returncode == 0, r
    for name in PIPELINES:
        assert name in r.stdout
    assert "a -> b" in r.stdout and "a -> broken" in r.stdout
    r = omnictl(d, "--json", "pipelines")
    assert r.returncode == 0 and json.loads(r.stdout) == d.client.pipelines(), r

    r = omnictl(d, "health")
    assert r.returncode == 0 and r.stdout.splitlines()[0] == "ready", r
    r = omnictl(d, "health", "--json")
    assert r.returncode == 0, r
    ready = json.loads(r.stdout)
    assert ready.pop("disk")["full"] is False, ready              # (the state dir's space: room enough)
    assert ready == {"ready": True, "stages": {name: "ready" for name in STAGES}, "not_ready": [],
                     "replicas_down": {}, "warming": [], "lazy": []}

    r = omnictl(d, "metrics")
    assert r.returncode == 0 and "# TYPE " in r.stdout, r
