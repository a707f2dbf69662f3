"""`omnictl` behaving like the CLIs people know, the real program against a real daemon:
`version` and `--version`, `completion bash|zsh|fish` and click's completion protocol answered
with the daemon's pipeline, stage and job names (quietly when it is down), `--json` honoured or
refused (exit 2) by every verb, `pipelines NAME`, `result --help`, the short-prefix message,
aligned `health` columns, and `submit --wait`'s progress bar on a terminal (a pty) next to the
byte-for-byte plain lines elsewhere.

One daemon for the module (python stages of tests/fixtures/teststages.py); every omnictl run is a
subprocess with a timeout; the pty is read until the child exits, with a deadline. About 15 s.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import ROOT, RunningDaemon, module_daemon, py_stage, run_on_a_pty, short_tmpdir, sigint_default, sleeper

from omnictl.cli import client_version

STAGES = {
    "words": py_stage("count", defaults={"n": 3, "delay": 0.01}),
    "tag": py_stage("echo", defaults={"tag": "b"}),
    "slow": sleeper(0.6),
}
PIPELINES = {
    "stream": {"stages": ["words", "tag"], "edges": [{"from": "words", "to": "tag", "window": 2}]},
    "one": {"stages": ["tag"]},
    "slow": {"stages": ["slow"]},
}
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
ENV.pop("OMNID_SOCKET", None)
NO_DAEMON = "/tmp/omnid-no-such-dir/omnid.sock"


@pytest.fixture(scope="module")
def daemon() -> Iterator[RunningDaemon]:
    with module_daemon(short_tmpdir(), STAGES, PIPELINES, ready_timeout=60) as rd:
        yield rd


def omnictl(where: RunningDaemon | str, *args: str, env: dict[str, str] | None = None,
            timeout: float = 30) -> subprocess.CompletedProcess[str]:
    sock = str(where.socket) if isinstance(where, RunningDaemon) else where
    return subprocess.run([sys.executable, "-m", "omnictl", "--socket", sock, *args], env={**ENV, **(env or {})},
                          capture_output=True, text=True, timeout=timeout, cwd=ROOT)


# ------------------------------------------------------------------ version


def test_version(daemon: RunningDaemon) -> None:
    mine = client_version()
    assert mine != "unknown"
    daemons = daemon.client.health()["version"]
    r = omnictl(daemon, "version")
    assert (r.returncode, r.stdout, r.stderr) == (0, f"client  {mine}\ndaemon  {daemons}\n", "")
    r = omnictl(daemon, "--json", "version")
    assert r.returncode == 0 and json.loads(r.stdout) == {"client": mine, "daemon": daemons}
    r = omnictl(NO_DAEMON, "version")
    assert r.returncode == 3 and r.stdout == f"client  {mine}\n", r
    assert r.stderr.startswith("omnictl: cannot reach omnid at"), r.stderr
    r = omnictl(NO_DAEMON, "--version")
    assert (r.returncode, r.stdout) == (0, f"omnictl {mine}\n")


# ------------------------------------------------------------------ completion


def complete(where: RunningDaemon | str, words: str) -> subprocess.CompletedProcess[str]:
    """click's bash protocol: COMP_WORDS is the line, COMP_CWORD the index of the word completed."""
    sock = str(where.socket) if isinstance(where, RunningDaemon) else where
    line = f"omnictl --socket {sock} {words}"
    cword = len(line.split()) - (0 if line.endswith(" ") else 1)
    return subprocess.run([sys.executable, "-m", "omnictl"], env={
        **ENV, "_OMNICTL_COMPLETE": "bash_complete", "COMP_WORDS": line, "COMP_CWORD": str(cword)},
        capture_output=True, text=True, timeout=30, cwd=ROOT)


def values(r: subprocess.CompletedProcess[str]) -> list[str]:
    assert r.returncode == 0 and r.stderr == "", r
    return [line.split(",", 1)[1] for line in r.stdout.splitlines() if line]


def test_completion_scripts() -> None:
    for shell, marker in (("bash", "complete -o nosort -F"), ("zsh", "#compdef omnictl"), ("fish", "complete ")):
        r = omnictl(NO_DAEMON, "completion", shell)
        assert r.returncode == 0 and "_OMNICTL_COMPLETE" in r.stdout and marker in r.stdout, (shell, r)
    r = omnictl(NO_DAEMON, "completion", "tcsh")
    assert r.returncode == 2


def test_completion_asks_the_daemon(daemon: RunningDaemon) -> None:
    assert {"status", "stage", "stages"} <= set(values(complete(daemon, "st")))
    assert set(values(complete(daemon, "submit --w"))) == {"--wait"}
    assert values(complete(daemon, "submit ")) == ["stream", "one", "slow"]
    assert values(complete(daemon, "pipelines s")) == ["stream", "slow"]
    assert values(complete(daemon, "stage restart ")) == ["words", "tag", "slow"]
    job = daemon.submit("one", {"text": "x"})
    daemon.wait(job, timeout=30)
    for verb in ("status", "cancel", "watch", "result", "rm"):
        assert job in values(complete(daemon, f"{verb} ")), verb
        assert values(complete(daemon, f"{verb} {job[:6]}")) == [job], verb
    # The daemon down: nothing offered, nothing said, quickly.
    t0 = time.monotonic()
    for words in ("submit ", "status ", "stage restart "):
        assert values(complete(NO_DAEMON, words)) == [], words
    assert time.monotonic() - t0 < 15


# ------------------------------------------------------------------ --json everywhere


def test_every_verb_honours_or_refuses_json(daemon: RunningDaemon, tmp_path: Path) -> None:
    job = json.loads(omnictl(daemon, "--json", "submit", "one", "--input", "text=x").stdout)["id"]
    waited = omnictl(daemon, "--json", "submit", "one", "--input", "text=y", "--wait", "-o", str(tmp_path / "w"))
    assert waited.returncode == 0 and all(json.loads(x)["type"] for x in waited.stdout.splitlines())
    daemon.wait(job, timeout=30)
    one_doc = {"status": [job], "cancel": [job], "result": [job, "-o", str(tmp_path / "r")], "watch": [job],
               "stages": [], "pipelines": [], "health": [], "metrics": [], "version": [],
               "status ": [], "pipelines ": ["one"], "stage": ["restart", "tag"]}
    for verb, args in one_doc.items():
        for r in (omnictl(daemon, "--json", verb.strip(), *args), omnictl(daemon, verb.strip(), *args, "--json")):
            assert r.returncode == 0, (verb, r)
            lines = r.stdout.splitlines()
            docs = [json.loads(r.stdout)] if r.stdout.startswith("{\n") else [json.loads(x) for x in lines]
            assert docs and all(isinstance(d, dict) for d in docs), (verb, r.stdout)
    metrics = json.loads(omnictl(daemon, "--json", "metrics").stdout)
    assert all(isinstance(s["labels"], dict) and "value" in s for samples in metrics.values() for s in samples)
    assert any(name.startswith("omnid_") for name in metrics), list(metrics)[:10]
    r = omnictl(daemon, "--json", "rm", job)
    assert r.returncode == 0 and json.loads(r.stdout) == {"deleted": job}
    # `completion` prints a shell script: --json is refused as a usage error.
    r = omnictl(daemon, "--json", "completion", "bash")
    assert r.returncode == 2 and "--json does not apply" in r.stderr and r.stdout == ""
    assert omnictl(daemon, "completion", "bash", "--json").returncode == 2


# ------------------------------------------------------------------ small manners


def test_pipelines_name(daemon: RunningDaemon) -> None:
    r = omnictl(daemon, "pipelines", "stream")
    assert r.returncode == 0, r
    assert "words -> tag  window 2" in r.stdout
    assert "stage words (python): unknown" in r.stdout
    assert re.search(r"PARAMS words \(python\): any \(the function reads what it wants\)\n\s+NAME\s+TYPE\s+DEFAULT\n"
                     r"\s+delay\s+any\s+0\.01\n\s+n\s+any\s+3\n", r.stdout), r.stdout
    r = omnictl(daemon, "pipelines", "nope")
    assert r.returncode == 4 and r.stderr.endswith("(unknown_pipeline)\n"), r


def test_result_help_names_no_dir_argument() -> None:
    r = omnictl(NO_DAEMON, "result", "--help")
    assert r.returncode == 0
    assert "Usage: omnictl result [OPTIONS] JOB" in r.stdout
    assert "into DIR" not in r.stdout and "-o/--output-dir" in r.stdout.split("Options:")[0], r.stdout


def test_short_prefix_message(daemon: RunningDaemon) -> None:
    r = omnictl(daemon, "status", "abc")
    assert r.returncode == 4
    assert r.stderr == "omnictl: no job 'abc': job id prefixes need at least 4 characters (unknown_job)\n"


def test_health_columns_are_aligned(daemon: RunningDaemon) -> None:
    r = omnictl(daemon, "health")
    assert r.returncode == 0, r
    lines = r.stdout.splitlines()
    assert lines[0] == "ready"
    assert lines[1:] == ["  words  ready", "  tag    ready", "  slow   ready"]


# ------------------------------------------------------------------ progress


def test_plain_progress_lines_when_not_a_terminal(daemon: RunningDaemon, tmp_path: Path) -> None:
    r = omnictl(daemon, "submit", "slow", "--wait", "-o", str(tmp_path / "p"))
    assert r.returncode == 0, r
    steps = [x for x in r.stderr.splitlines() if x.startswith("slow: step")]
    assert steps == [f"slow: step {i}/60" for i in range(1, 60, 10)], r.stderr
    assert "\x1b" not in r.stderr and "\r" not in r.stderr


def test_progress_bar_on_a_terminal(daemon: RunningDaemon) -> None:
    code, text = run_on_a_pty([sys.executable, "-m", "omnictl", "--socket", str(daemon.socket), "submit", "slow",
                               "--wait", "-o", str(daemon.dir / "tty-out")], ENV)
    assert code == 0, text
    plain = re.sub(r"\x1b\[[0-9;]*[mK]", "", text)
    bars = [x.strip() for x in re.split(r"[\r\n]", plain) if x.startswith("slow: ") and "/60" in x]
    assert bars and all(re.fullmatch(r"slow: [━╸╺ ]+ +\d+/60 (\?|\d+\.\d) steps/s (-:--:--|\d:\d\d:\d\d)", b)
                        for b in bars), (bars, text)
    assert any(re.search(r"\d+\.\d steps/s \d:\d\d:\d\d$", b) for b in bars), bars    # a rate and a time left
    assert "slow: step" not in plain


def test_children_of_the_suite_start_with_sigint_at_its_default() -> None:
    # As under `nohup make test &`: this process ignores SIGINT, and a child would inherit that.
    old = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        probe = "import signal; print(signal.getsignal(signal.SIGINT) is signal.default_int_handler)"
        plain = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=30)
        fixed = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=30,
                                preexec_fn=sigint_default)
    finally:
        signal.signal(signal.SIGINT, old)
    assert plain.stdout.strip() == "False", "the probe cannot tell: an ignored SIGINT was not inherited"
    assert fixed.stdout.strip() == "True", fixed
