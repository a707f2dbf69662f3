"""Schemathesis against omnid's own `/v1/openapi.json`: generated requests, real answers.

A real daemon (python stages only, so thousands of cases stay quick) serves its TCP listener; the
`schemathesis` CLI reads the document from it and sends schema-valid and schema-violating
requests to every operation, with a key that acts as root (so the admin operations are reached
too). Its checks (no 5xx, statuses, headers such as `Allow` on 405, content types, answers valid
against the document, valid data accepted and invalid data refused) must all pass.

Left out: the four OpenAI generation paths (chat, completions, images, speech), whose answers are
validated against OpenAI's own published schemas in tests/test_tcp.py instead (here each case
would be a job of a model); and the stream of a followed log, which never ends
(tests/fixtures/schemathesis_hooks.py sends those cases with follow=0).

`make schemathesis` runs this test with more cases (OMNID_SCHEMATHESIS_EXAMPLES).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from conftest import FIXTURES, RunningDaemon, omnictl, py_stage, sleeper, wait_for

pytest.importorskip("schemathesis")

EXAMPLES = int(os.environ.get("OMNID_SCHEMATHESIS_EXAMPLES", "5"))
LEFT_OUT = r"^/v1/(chat/completions|completions|images/generations|audio/speech|realtime)$"


@pytest.mark.timeout(900)
def test_schemathesis_finds_nothing(start_daemon: Callable[..., RunningDaemon], tmp_path: Path) -> None:
    from test_tcp import add_key, free_port
    port = free_port()
    d = start_daemon({"echo": py_stage("echo"), "nap": sleeper(0.2)},
                     {"echo": {"stages": ["echo"]}, "nap": {"stages": ["nap"]}},
                     {"listen": [f"127.0.0.1:{port}"]})
    key = add_key(d, "fuzz", "--uid", "0", "--admin")     # (the admin paths fuzzed too)
    cli = shutil.which("schemathesis", path=str(Path(sys.executable).parent)) or "schemathesis"
    env = {**os.environ, "SCHEMATHESIS_HOOKS": "schemathesis_hooks", "OMNID_FUZZ_BASE": f"http://127.0.0.1:{port}",
           "OMNID_FUZZ_KEY": key,
           "PYTHONPATH": os.pathsep.join([str(FIXTURES), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([cli, "run", f"http://127.0.0.1:{port}/v1/openapi.json", "-H", f"Authorization: Bearer {key}",
                           "--max-examples", str(EXAMPLES), "--seed", "1", "--workers", "1", "--request-timeout", "20",
                           "--exclude-path-regex", LEFT_OUT, "--no-color"],
                          capture_output=True, text=True, timeout=840, cwd=str(tmp_path), env=env)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-12000:]
    assert "No issues found" in out or " passed" in out, out[-4000:]
    assert d.proc.poll() is None, "the daemon must survive the run"
    # The run restarts, puts to sleep and wakes stages: each is back (ready) within a minute.
    wait_for(lambda: omnictl(d, "health").returncode == 0, 60, "every stage ready again after the run")
