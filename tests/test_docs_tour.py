"""The README's five-minute tour, run as written: its `sh` blocks (but `make models`, which the suite has
done) and its Python block, in one shell, in a copy of the checkout's layout (etc/ copied, .models and
.venv linked), so that the tour's own `omnid -c etc/omnid-demo.toml &` starts the demo daemon and every
`omnictl` and curl line after it talks to it. Then what the tour promises is there: the omni answer's
text and audio, the fox's files, a streamed chat.

About 2-4 minutes on 2 cores (the demo daemon loads every stage of the demo config).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import MODELS, short_tmpdir, sigint_default

ROOT = Path(__file__).resolve().parents[1]
pytestmark = [pytest.mark.timeout(1200), pytest.mark.vllm]


def tour() -> tuple[list[str], str]:
    """The tour section's sh blocks and its python block."""
    readme = (ROOT / "README.md").read_text()
    section = readme.split("\n## A five-minute tour\n", 1)[1].split("\n## ", 1)[0]
    sh = re.findall(r"```sh\n(.*?)```", section, re.S)
    [python] = re.findall(r"```python\n(.*?)```", section, re.S)
    return sh, python


def script(sh: list[str], python: str) -> str:
    lines = ["set -euo pipefail"]
    for block in sh:
        for line in block.splitlines():
            line = re.sub(r"^make models(\s*&&\s*)?", "", line)     # (the suite has made them)
            if not line.strip() or line.lstrip().startswith("#"):
                continue
            lines.append(line)
            if re.search(r"&\s*(#.*)?$", line):      # the daemon, in the background: stopped when the tour ends
                lines.append("DAEMON=$!; trap 'kill -TERM $DAEMON; wait $DAEMON' EXIT")
    lines += ["echo '--- python'", f".venv/bin/python - <<'PY'\n{python}PY", "echo",
              "echo '--- omni trace'",
              "omnictl trace \"$(omnictl --json status | .venv/bin/python -c "
              "'import json, sys; print(next(j[\"id\"] for j in json.load(sys.stdin)[\"jobs\"] if j[\"pipeline\"] == \"omni\"))')\""]
    return "\n".join(lines) + "\n"


def test_the_tour_has_the_lines_the_readme_promises() -> None:
    sh, python = tour()
    text = "\n".join(sh)
    assert "omnid -c etc/omnid-demo.toml" in text and "submit omni" in text
    assert len([line for line in text.splitlines() if line.startswith(("omnictl ", "JOB=$(omnictl"))]) >= 8
    assert len([line for line in text.splitlines() if line.startswith("curl ")]) == 3
    assert "client.chat.completions.create" in python


def _venv(bin_parent: Path) -> None:
    """The checkout's .venv/bin as the tour names it: this interpreter, and omnid and omnictl run by it
    (under `make test-vllm` the running venv is one layered on .venv, without the scripts)."""
    bin_dir = bin_parent / "bin"
    bin_dir.mkdir(parents=True)
    for name, run in (("python", ""), ("omnid", " -m omnid"), ("omnictl", " -m omnictl")):
        script = bin_dir / name         # (scripts, not links: the venv is found from the path it is run by)
        script.write_text(f'#!/bin/sh\nexec "{sys.executable}"{run} "$@"\n')
        script.chmod(0o755)


def test_the_readme_tour_runs_as_written() -> None:
    d = short_tmpdir()
    try:
        shutil.copytree(ROOT / "etc", d / "etc")
        (d / ".models").symlink_to(MODELS)
        _venv(d / ".venv")
        env = {k: v for k, v in os.environ.items() if k != "OMNID_SOCKET"}
        env["PYTHONPATH"] = str(ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        sh, python = tour()
        run = subprocess.run(["bash", "-c", script(sh, python)], cwd=d, env=env, capture_output=True, text=True,
                             timeout=1100, preexec_fn=sigint_default)
        log_path = d / ".run/omnid.log"
        log = log_path.read_text(errors="replace")[-4000:] if log_path.exists() else ""
        assert run.returncode == 0, f"{run.stdout[-4000:]}\n--- stderr\n{run.stderr[-4000:]}\n--- omnid.log\n{log}"
        print(run.stdout[-6000:])
        out = run.stdout
        out_dir = d / "demo-out"
        assert (out_dir / "hello/thinker.text.txt").read_text().strip()
        wav = (out_dir / "hello/code2wav.audio.wav").read_bytes()
        assert wav[:4] == b"RIFF" and len(wav) > 4096, len(wav)
        assert (out_dir / "fox/image.png").read_bytes()[:4] == b"\x89PNG"
        assert (out_dir / "fox/prompt.txt").read_text().strip()
        assert (out_dir / "fox.png").read_bytes()[:4] == b"\x89PNG"
        assert '"type": "state"' in out or '"type":"state"' in out          # the events, NDJSON
        assert "--- python\n" in out and out.split("--- python\n", 1)[1].split("\n")[0].strip()   # the chat's words
        assert re.search(r"^\s+thinker\s", out.split("--- omni trace", 1)[1], re.M)
    finally:
        shutil.rmtree(d, ignore_errors=True)
