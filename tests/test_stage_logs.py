"""Per-stage logs (`omnictl logs`): each worker's stdout and stderr captured into its own bounded,
rotating file under <state_dir>/logs and still forwarded to the daemon's stderr; the daemon's own
records in omnid.log; `--since`, `--tail`, `-f`; admins only; a killed worker logs on.

Every wait is bounded (conftest's `wait_for`, subprocess timeouts, `select` with a deadline).
"""

from __future__ import annotations

import json
import os
import select
import signal
import stat
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from conftest import MODELS, ROOT, RunningDaemon, interrupt, omnictl, sigint_default, tiny_sd, wait_for, wait_started
from test_reload import _as_nobody

from omnictl.client import Client

Start = Callable[..., RunningDaemon]

STAGE_MODULE = '''
import logging
import os
import sys
import time

def run(inputs, params, ctx):
    text = inputs.get("text", "")
    print(f"stdout says {text}")
    print(f"stderr says {text}", file=sys.stderr)
    logging.getLogger("x").warning("logger x says %s", text)
    for i in range(int(params.get("lines", 0))):
        print(f"filler {text} {i:05d} " + "x" * 80)
    time.sleep(float(params.get("linger", 0)))
    return {"text": text, "pid": os.getpid()}
'''


def talker(tmp: Path) -> dict[str, Any]:
    (tmp / "talkstage.py").write_text(STAGE_MODULE)
    return {"engine": "python", "function": "talkstage:run", "python_path": [str(tmp)],
            "defaults": {"lines": 0, "linger": 0}}


def run_job(d: RunningDaemon, text: str, **params: Any) -> None:
    job = d.submit("p", {"text": text}, {"s": params} if params else None)
    assert d.wait(job, timeout=60)["state"] == "succeeded", d.diagnose(job)


def logs_of(d: RunningDaemon, stage: str | None = None, **kw: Any) -> list[str]:
    return list(d.client.logs(stage, **kw))


@pytest.fixture
def daemon(start_daemon: Start, tmp_path: Path) -> RunningDaemon:
    return start_daemon({"s": talker(tmp_path)}, {"p": {"stages": ["s"]}}, {"socket_mode": "0666"})


def test_stdout_stderr_and_logging_reach_omnictl_logs(daemon: RunningDaemon) -> None:
    d = daemon
    run_job(d, "marker-17")
    out = wait_for(lambda: (r := omnictl(d, "logs", "s")).returncode == 0 and "stderr says marker-17" in r.stdout
                   and "logger x says marker-17" in r.stdout and r.stdout, 10, "the job's lines in `omnictl logs s`")
    lines = out.splitlines()
    assert "stdout says marker-17" in lines and "stderr says marker-17" in lines, out
    record = json.loads(next(line for line in lines if "logger x says marker-17" in line))
    assert record["level"] == "warning" and record["logger"] == "x" and record["stage"] == "s"
    # The worker's own start-up records are there too, and none of the daemon's.
    assert not any('"process": "supervisor"' in line for line in lines), out
    # -t: each line with the UTC time the daemon read it; --json: {"ts", "line"}
    stamped = omnictl(d, "logs", "s", "-t").stdout.splitlines()
    assert any(line.endswith(" stdout says marker-17") and line[:24].endswith("Z") for line in stamped), stamped
    docs = [json.loads(line) for line in omnictl(d, "logs", "s", "--json").stdout.splitlines()]
    assert {"ts": docs[-1]["ts"], "line": docs[-1]["line"]} == docs[-1] and \
        any(doc["line"] == "stdout says marker-17" for doc in docs)
    # Still one stream on the daemon's stderr (JSON lines): the plain lines forwarded, each wrapped
    # as a record of its stage.
    records = [json.loads(line) for line in d.log().splitlines() if line.startswith("{")]
    wrapped = {r["line"]: r for r in records if r.get("event") == "stderr"}
    assert {"stdout says marker-17", "stderr says marker-17"} <= set(wrapped), d.log()
    assert wrapped["stdout says marker-17"]["stage"] == "s"
    # Private files: logs/ and logs/stages/ 0700, the file 0600.
    logs = d.state_dir / "logs"
    for folder in (logs, logs / "stages"):
        assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    assert stat.S_IMODE((logs / "stages" / "s.log").stat().st_mode) == 0o600
    assert stat.S_IMODE((logs / "omnid.log").stat().st_mode) == 0o600


def test_since_and_tail_filter(daemon: RunningDaemon) -> None:
    d = daemon
    run_job(d, "early-1")
    wait_for(lambda: any("early-1" in line for line in logs_of(d, "s")), 10, "the first job's lines")
    time.sleep(1.1)
    between = time.time()
    time.sleep(0.1)
    run_job(d, "late-2")
    wait_for(lambda: any("logger x says late-2" in line for line in logs_of(d, "s")), 10, "the second job's lines")
    recent = omnictl(d, "logs", "s", "--since", str(between)).stdout
    assert "late-2" in recent and "early-1" not in recent, recent
    iso = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(between)) + f".{int(between * 1000) % 1000:03d}Z"
    assert logs_of(d, "s", since=iso) == [line for line in logs_of(d, "s") if line[:24] >= iso[:24]]
    everything = omnictl(d, "logs", "s", "--since", "1h").stdout
    assert "early-1" in everything and "late-2" in everything
    last = omnictl(d, "logs", "s", "--tail", "2").stdout.splitlines()
    assert len(last) == 2 and last == omnictl(d, "logs", "s").stdout.splitlines()[-2:]
    assert omnictl(d, "logs", "s", "--tail", "0").stdout == ""
    bad = omnictl(d, "logs", "s", "--since", "yesterday-ish")
    assert bad.returncode == 4 and "invalid_request" in bad.stderr and "since must be" in bad.stderr, bad.stderr
    unknown = omnictl(d, "logs", "nope")
    assert unknown.returncode == 4 and "unknown_stage" in unknown.stderr


def test_follow_shows_new_lines_live(daemon: RunningDaemon) -> None:
    d = daemon
    proc = subprocess.Popen([sys.executable, "-m", "omnictl", "--socket", str(d.socket), "logs", "s", "-f"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={**os.environ, "PYTHONPATH": str(ROOT)},
                            preexec_fn=sigint_default)
    try:
        out = proc.stdout
        assert out is not None
        seen = b""

        def read_until(marker: bytes, timeout: float) -> None:
            nonlocal seen
            deadline = time.monotonic() + timeout
            while marker not in seen:
                left = deadline - time.monotonic()
                assert left > 0 and proc.poll() is None, f"no {marker!r} from `omnictl logs -f` in time: {seen[-2000:]!r}"
                ready, _, _ = select.select([out], [], [], left)
                if ready:
                    seen += os.read(out.fileno(), 65536)

        time.sleep(0.3)                                     # following (the old lines, if any, shown)
        job = d.submit("p", {"text": "live-1"}, {"s": {"linger": 30}})
        t0 = time.monotonic()
        read_until(b"stdout says live-1", 10)               # while the job still runs (it lingers 30 s)
        assert time.monotonic() - t0 < 10
        assert d.client.job(job)["state"] == "running"
        read_until(b"logger x says live-1", 10)
        d.client.cancel(job)
        run_job(d, "live-2")
        read_until(b"stderr says live-2", 10)
    finally:
        interrupt(proc)
    assert proc.returncode == 130


def test_rotation_keeps_the_files_bounded(start_daemon: Start, tmp_path: Path) -> None:
    cap, keep = 4000, 2
    d = start_daemon({"s": talker(tmp_path)}, {"p": {"stages": ["s"]}},
                     {"log_file_max_bytes": cap, "log_file_keep": keep})
    for i in range(3):
        run_job(d, f"bulk-{i}", lines=100)                 # ~11 KB a job
    folder = d.state_dir / "logs" / "stages"
    wait_for(lambda: any("filler bulk-2 00099" in line for line in logs_of(d, "s")), 10, "the last job's lines")
    names = sorted(p.name for p in folder.iterdir())
    assert names == ["s.log", "s.log.1", "s.log.2"], names
    for p in folder.iterdir():
        assert p.stat().st_size <= cap, (p, p.stat().st_size)
    # What is read back is the files in order, oldest first, whole lines only.
    lines = logs_of(d, "s")
    fillers = [line.split(" ")[3] for line in lines if " filler bulk-2 " in line]
    assert fillers == sorted(fillers) and fillers[-1] == "00099"
    assert not any("bulk-0" in line for line in lines)     # rotated away
    # The daemon's own file is bounded the same way.
    assert all(p.stat().st_size <= cap for p in (d.state_dir / "logs").glob("omnid.log*"))


def test_daemon_log(daemon: RunningDaemon) -> None:
    d = daemon
    run_job(d, "audit-me")
    r = wait_for(lambda: (r := omnictl(d, "logs")).returncode == 0 and '"action": "submit"' in r.stdout and r,
                 10, "the submit's audit line in `omnictl logs`")
    docs = [json.loads(line) for line in r.stdout.splitlines()]
    assert all(doc["process"] == "supervisor" for doc in docs), r.stdout
    events = [doc["event"] for doc in docs]
    assert "listening" in events and "ready" in events and "stage worker spawned" in events
    assert not any("stdout says" in line for line in r.stdout.splitlines())
    assert (d.state_dir / "logs" / "omnid.log").is_file()
    # --tail works on it too
    assert len(omnictl(d, "logs", "--tail", "1").stdout.splitlines()) == 1


def test_only_root_or_admins_may_read_logs(daemon: RunningDaemon) -> None:
    d = daemon
    os.chmod(d.dir, 0o711)                             # (mkdtemp made it 0700): nobody may reach the socket
    assert _as_nobody(lambda: list(Client(str(d.socket)).logs("s"))) == (403, "not_admin")
    assert _as_nobody(lambda: list(Client(str(d.socket)).logs())) == (403, "not_admin")
    assert _as_nobody(lambda: Client(str(d.socket)).health()) == (0, "none")   # the socket itself is open


def test_a_killed_worker_logs_on_into_the_same_file(daemon: RunningDaemon) -> None:
    d = daemon
    run_job(d, "before-kill")
    old = d.stage_pid("s")
    path = d.state_dir / "logs" / "stages" / "s.log"
    inode = path.stat().st_ino
    os.kill(old, signal.SIGKILL)
    wait_for(lambda: (s := d.stages()["s"])["state"] == "ready" and s["pid"] not in (None, old), 30,
             "the stage to be restarted")
    run_job(d, "after-kill")
    lines = wait_for(lambda: (ls := logs_of(d, "s")) and any("stderr says after-kill" in line for line in ls) and ls,
                     10, "the new worker's lines")
    text = "\n".join(lines)
    assert text.index("stdout says before-kill") < text.index("stdout says after-kill")
    assert path.stat().st_ino == inode
    # The daemon's log says why in between.
    assert any("stage worker died" in line for line in logs_of(d))


@pytest.mark.engines
def test_follow_a_diffusers_stage_while_it_draws(start_daemon: Start) -> None:
    """`omnictl logs draw -f` while a diffusers job runs: a line the worker writes mid-job (written
    here into its fd 2, /proc/PID/fd/2, the very pipe) comes out at once, the job goes on."""
    if not (MODELS / "sd" / ".omnid-tiny-ok").exists():
        pytest.skip("no tiny SD model (python -m omnid.tinymodels .models)")
    defaults = {"num_inference_steps": 400, "guidance_scale": 5.0, "seed": 0, "height": 64, "width": 64}
    d = start_daemon({"draw": tiny_sd(defaults)},
                     {"draw": {"stages": ["draw"]}}, {"heartbeat_timeout_s": 60.0, "cancel_grace_s": 60.0})
    proc = subprocess.Popen([sys.executable, "-m", "omnictl", "--socket", str(d.socket), "logs", "draw", "-f"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={**os.environ, "PYTHONPATH": str(ROOT)},
                            preexec_fn=sigint_default)
    try:
        assert proc.stdout is not None
        job = d.submit("draw", {"prompt": "a red square"})
        wait_started(d, job, "draw", timeout=60)
        seen = b""
        for n in range(3):
            assert d.client.job(job)["state"] == "running", "the job ended too soon to test anything"
            marker = f"mid-job line {n} {time.time()}".encode()
            with open(f"/proc/{d.stage_pid('draw')}/fd/2", "wb") as worker_stderr:
                worker_stderr.write(marker + b"\n")
            deadline = time.monotonic() + 5
            while marker not in seen:
                left = deadline - time.monotonic()
                assert left > 0 and proc.poll() is None, f"{marker!r} not followed in time: {seen[-2000:]!r}"
                if select.select([proc.stdout], [], [], left)[0]:
                    seen += os.read(proc.stdout.fileno(), 65536)
        d.client.cancel(job)
        assert d.wait(job, timeout=120)["state"] == "cancelled"
    finally:
        interrupt(proc)
    assert proc.returncode == 130
