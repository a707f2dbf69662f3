"""Private by default: another local user reads nothing of omnid's state dir.

The daemon runs as root (the test's uid), a job writes outputs, and a second real
uid, 65534 (nobody), tries the files directly: the state dir, the job database,
the job's folder, `manifest.json`, an output. Every attempt must fail with EACCES,
whatever umask the daemon was started with (the test starts it with umask 0);
through the API the same user is told the job is not theirs (403 `not_yours`).
The probes run in a fresh process (exec'd, no file descriptor of ours inherited)
as nobody; they need root to switch uid, so the file is skipped for other users.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import py_stage, short_tmpdir

from omnid.store import JobStore
from omnid.worker.outputs import StreamWriter, stream_file, write_outputs

NOBODY = 65534

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="switching to a second uid needs root")


# What the second user tries. Standard library only: it runs under whichever python nobody may execute.
PROBE = r'''
import http.client, json, os, socket, sys

class UnixHTTP(http.client.HTTPConnection):
    def __init__(self, path):
        super().__init__("localhost", timeout=10)
        self.path = path

    def connect(self):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.connect(self.path)

def attempt(op, arg):
    try:
        if op == "listdir":
            os.listdir(arg)
        elif op == "read":
            with open(arg, "rb") as f:
                f.read(1)
        elif op == "get":
            sock, url = arg
            conn = UnixHTTP(sock)
            conn.request("GET", url)
            resp = conn.getresponse()
            body = json.loads(resp.read() or b"null")
            return [resp.status, (body.get("error") or {}).get("code") if isinstance(body, dict) else None]
        return "ok"
    except OSError as e:
        return e.__class__.__name__ + ":" + (os.strerror(e.errno) if e.errno else str(e))

print(json.dumps({"uid": os.getuid(), "results": [attempt(op, arg) for op, arg in json.loads(sys.argv[1])]}))
'''

DENIED = "PermissionError:" + os.strerror(13)


@functools.cache
def _python_for_nobody() -> str | None:
    """A python interpreter uid 65534 can execute (the test's own may live under /root, 0700)."""
    for candidate in (sys.executable, shutil.which("python3"), "/usr/bin/python3"):
        try:
            if candidate and subprocess.run([candidate, "-c", "pass"], user=NOBODY, group=NOBODY, extra_groups=[],
                                            capture_output=True, timeout=30).returncode == 0:
                return candidate
        except OSError:
            pass
    return None


def as_nobody(*attempts: tuple[str, Any]) -> list[Any]:
    """Run each (op, arg) of PROBE as uid/gid 65534 with no supplementary groups; their results in order."""
    python = _python_for_nobody()
    if python is None:
        pytest.skip("no python interpreter that uid 65534 may execute")
    result = subprocess.run([python, "-I", "-c", PROBE, json.dumps(attempts)],
                            user=NOBODY, group=NOBODY, extra_groups=[], cwd="/",
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    doc = json.loads(result.stdout)
    assert doc["uid"] == NOBODY
    return list(doc["results"])


def every_path(top: Path) -> Iterator[Path]:
    yield top
    for folder, dirs, files in os.walk(top):
        for name in dirs + files:
            yield Path(folder) / name


def not_private(top: Path) -> list[str]:
    """Whatever under `top` (itself included) grants group or other users any access."""
    return [f"{p} {stat.filemode(p.lstat().st_mode)}" for p in every_path(top) if p.lstat().st_mode & 0o077]


@pytest.fixture
def open_dir() -> Iterator[Path]:
    """A short directory that everyone may enter (0755, like /var/lib): only omnid's own modes keep
    other users out of what it makes inside."""
    d = short_tmpdir()
    os.chmod(d, 0o755)
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def umask_zero() -> Iterator[None]:
    """Start daemons (and write files) with umask 0: nothing may rely on the caller's umask."""
    old = os.umask(0)
    yield
    os.umask(old)


# ------------------------------------------------------------------------- a real daemon, a second uid


def test_another_user_reads_nothing_of_the_state_dir(start_daemon, open_dir: Path, umask_zero: None) -> None:
    rd = start_daemon({"s": py_stage("files")}, {"p": {"stages": ["s"]}}, {"socket_mode": "0666"}, dir=open_dir)
    job = rd.wait(rd.submit("p", {"text": "a prompt nobody else may read"}))
    assert job["state"] == "succeeded", rd.diagnose(job["id"])
    folder = rd.state_dir / "jobs" / job["id"]
    outputs = {o["name"]: folder / o["file"] for o in job["outputs"]}
    targets = [("listdir", str(rd.state_dir)), ("read", str(rd.state_dir / "omnid.db")),
               ("listdir", str(rd.state_dir / "jobs")), ("listdir", str(folder)),
               ("read", str(folder / "manifest.json")), ("read", str(outputs["text"])),
               ("read", str(outputs["picture"]))]
    # the owner can (and these paths are right: the denials below are not typos)
    assert (folder / "manifest.json").is_file() and outputs["text"].read_text() == "hello"
    assert "a prompt nobody else may read" in (folder / "manifest.json").read_text()
    assert {"jobs", "omnid.db"} <= set(os.listdir(rd.state_dir))
    # nobody: every attempt fails with EACCES
    results = as_nobody(*targets)
    assert results == [DENIED] * len(targets), list(zip(targets, results))
    # through the API (the 0666 socket lets nobody in): the job is not theirs
    sock = str(rd.socket)
    got = as_nobody(("get", (sock, f"/v1/jobs/{job['id']}")),
                    ("get", (sock, f"/v1/jobs/{job['id']}/outputs/text")),
                    ("get", (sock, "/v1/health")))
    assert got[:2] == [[403, "not_yours"], [403, "not_yours"]], got
    assert got[2][0] == 200, got
    # and not by luck: the state dir, its database, every job folder and file: the daemon's user's alone
    assert stat.S_IMODE(rd.state_dir.stat().st_mode) == 0o700
    assert stat.S_IMODE(outputs["text"].stat().st_mode) == 0o600
    assert not not_private(rd.state_dir), (
        "group/other access under the state dir (is the daemon's umask set at start?):\n"
        + "\n".join(not_private(rd.state_dir)))


def test_the_output_writer_makes_private_files_whatever_the_umask(tmp_path: Path, umask_zero: None) -> None:
    # The daemon's umask (set at start) would hide a writer that asks for 0644: here the writer
    # runs in this process, under umask 0, so only the modes it asks for count.
    from omnid.worker.outputs import write_outputs
    job_dir = tmp_path / "jobs" / "j1"
    written = write_outputs("j1", job_dir, {"text": "hello", "data": b"\x00raw bytes"})
    assert len(written) == 2 and all((job_dir / o.file).is_file() for o in written), written
    modes = {str(p.relative_to(tmp_path)): stat.S_IMODE(p.stat().st_mode) for p in every_path(tmp_path / "jobs")}
    assert modes == {k: 0o700 if (tmp_path / k).is_dir() else 0o600 for k in modes}, modes


def test_an_old_state_dir_is_tightened_and_the_socket_stays_0660(start_daemon, open_dir: Path,
                                                                  umask_zero: None) -> None:
    # as an older omnid left it: everything open to all
    old_job = open_dir / "state" / "jobs" / "0ld"
    old_job.mkdir(parents=True)
    (old_job / "text.txt").write_text("an old output")
    for p in (open_dir / "state", open_dir / "state" / "jobs", old_job):
        os.chmod(p, 0o755)
    os.chmod(old_job / "text.txt", 0o644)
    rd = start_daemon({"s": py_stage("echo")}, {"p": {"stages": ["s"]}}, dir=open_dir)
    # the top folders are tightened at start; old job folders are not walked, and need not be
    assert stat.S_IMODE(rd.state_dir.stat().st_mode) == 0o700
    assert stat.S_IMODE((rd.state_dir / "jobs").stat().st_mode) == 0o700
    assert stat.S_IMODE(old_job.stat().st_mode) == 0o755
    assert as_nobody(("read", str(old_job / "text.txt")), ("listdir", str(old_job))) == [DENIED, DENIED]
    # the default socket mode: 0660 (root and the socket's group), so nobody cannot even connect
    assert stat.S_IMODE(rd.socket.stat().st_mode) == 0o660
    assert as_nobody(("get", (str(rd.socket), "/v1/health"))) == [DENIED]


# ------------------------------------------------------------------------- the modes, in process


def test_the_store_and_the_output_writer_make_private_files_whatever_the_umask(tmp_path: Path,
                                                                               umask_zero: None) -> None:
    state = tmp_path / "new" / "state"
    store = JobStore(state)
    try:
        folder = store.job_dir("j1")
        write_outputs("j1", folder, {"text": "hi", "meta": {"n": 1}})
        writer = StreamWriter(store.job_dir("j2"))
        writer.append({"text": "a segment"})
        writer.close()
        assert stream_file(store.job_dir("j2"), "text").read_text() == "a segment"
        store.flush()
    finally:
        store.close()
    made = {p.relative_to(state).as_posix(): stat.S_IMODE(p.lstat().st_mode) for p in every_path(state)}
    assert made["."] == 0o700 and made["jobs"] == 0o700 and made["jobs/j1"] == 0o700
    assert made["jobs/j2"] == 0o700 and made["jobs/j2/.stream"] == 0o700
    assert made["omnid.db"] == 0o600 and made["omnid.lock"] == 0o600
    assert made["jobs/j1/text.txt"] == 0o600 and made["jobs/j1/meta.json"] == 0o600
    assert made["jobs/j2/.stream/text"] == 0o600
    assert not not_private(state), not_private(state)
