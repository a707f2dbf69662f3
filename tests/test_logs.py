"""The daemon's log: one stream of JSON lines off a terminal (the workers' and their libraries'
records included), journald priorities, console when forced, and audit lines."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

from conftest import RunningDaemon, short_tmpdir, sleeper, wait_started

TIMESTAMP = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z$")

STAGE_MODULE = '''
import logging
import os
import sys
import warnings

def run(inputs, params, ctx):
    print("a plain print", inputs.get("text"), flush=True)
    sys.stderr.write("steps:  50%|#####     | 5/10\\rsteps: 100%|##########| 10/10\\n")
    sys.stderr.flush()
    os.write(2, b"libfoo: warning: a C library writes to fd 2 itself\\n")
    logging.getLogger("diffusers").warning("diffusers says %s", inputs.get("text"))
    logging.getLogger("diffusers").info("diffusers info is below the library floor")
    warnings.warn("an old argument", FutureWarning)
    return {"text": "ok"}
'''


def lib_stage(tmp: Path) -> dict[str, Any]:
    (tmp / "loggingstage.py").write_text(STAGE_MODULE)
    return {"engine": "python", "function": "loggingstage:run", "python_path": [str(tmp)]}


def json_lines(text: str) -> list[dict[str, Any]]:
    docs = []
    for line in text.splitlines():
        if line.strip():
            try:
                docs.append(json.loads(line))
            except ValueError:
                raise AssertionError(f"not a JSON line: {line!r}") from None
    return docs


def test_every_line_is_json_with_stage_records_and_audit(start_daemon, tmp_path: Path) -> None:
    d: RunningDaemon = start_daemon({"lib": lib_stage(tmp_path), "slow": sleeper(30)},
                                    {"p": {"stages": ["lib"]}, "slow": {"stages": ["slow"]}})
    done = d.submit("p", {"text": "marker-41"})
    assert d.wait(done, timeout=60)["state"] == "succeeded"
    slow = d.submit("slow")
    wait_started(d, slow, "slow")
    d.client.cancel(slow)
    d.wait(slow, timeout=30)
    d.client.delete(done)
    assert d.stop() == 0
    docs = json_lines(d.log())
    for doc in docs:
        assert TIMESTAMP.match(doc["timestamp"]) and doc["level"] and doc["event"], doc
    events = [doc["event"] for doc in docs]
    assert "ready" in events and "stopped" in events
    lib = [doc for doc in docs if doc["event"] == "diffusers says marker-41"]
    assert len(lib) == 1, events
    assert lib[0]["stage"] == "lib" and lib[0]["logger"] == "diffusers" and lib[0]["level"] == "warning"
    assert lib[0]["process"] == "stage:lib"
    assert not any("below the library floor" in e for e in events)
    # what the stage wrote past logging, each line wrapped as a record of its stage
    raw = {doc["line"]: doc for doc in docs if doc["event"] == "stderr"}
    assert set(raw) == {"a plain print marker-41", "steps: 100%|##########| 10/10",
                        "libfoo: warning: a C library writes to fd 2 itself"}, raw
    assert all(doc["stage"] == "lib" and doc["process"] == "stage:lib" for doc in raw.values())
    assert raw["libfoo: warning: a C library writes to fd 2 itself"]["level"] == "warning"
    assert raw["a plain print marker-41"]["level"] == "info"
    warned = [doc for doc in docs if doc.get("logger") == "py.warnings"]
    assert warned and "FutureWarning: an old argument" in warned[0]["event"] and warned[0]["stage"] == "lib"
    audit = [(doc["action"], doc["job"], doc["pipeline"], doc["uid"]) for doc in docs if doc["event"] == "audit"]
    uid = os.getuid()
    assert audit == [("submit", done, "p", uid), ("submit", slow, "slow", uid), ("cancel", slow, "slow", uid),
                     ("delete", done, "p", uid)], audit
    assert all(doc["level"] == "info" for doc in docs if doc["event"] == "audit")


def test_journald_stream_gets_priority_prefixes(start_daemon) -> None:
    d_dir = short_tmpdir()
    log_path = d_dir / "omnid-0.log"          # the fixture's name for this test's first daemon's log
    log_path.touch()
    st = log_path.stat()
    d: RunningDaemon = start_daemon({"s": sleeper(0.01)}, {"p": {"stages": ["s"]}}, dir=d_dir,
                                    env={"JOURNAL_STREAM": f"{st.st_dev}:{st.st_ino}"})
    assert d.log_path == log_path
    d.wait(d.submit("p"), timeout=30)
    assert d.stop() == 0
    lines = [line for line in d.log().splitlines() if line.strip()]
    assert lines
    for line in lines:
        m = re.match(r"^<([0-7])>(\{.*\})$", line)
        assert m, f"no priority prefix: {line!r}"
        doc = json.loads(m.group(2))
        assert int(m.group(1)) == {"debug": 7, "info": 6, "warning": 4, "error": 3, "critical": 2}[doc["level"]]
    assert any(line.startswith("<6>") and '"event": "ready"' in line for line in lines)


def test_console_format_when_forced(start_daemon) -> None:
    d: RunningDaemon = start_daemon({"s": sleeper(0.01)}, {"p": {"stages": ["s"]}}, {"log_format": "console"})
    assert d.stop() == 0
    text = d.log()
    assert "\x1b[" not in text, "no colour off a terminal"
    assert re.search(r"^\d{4}-\d\d-\d\dT[\d:.]+Z \[info\s*\] ready ", text, re.M), text[-2000:]
    assert re.search(r"stage worker spawned.*\bpid=\d+.*stage=s\b", text), text[-2000:]
    assert not any(line.startswith("{") for line in text.splitlines())
