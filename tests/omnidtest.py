"""What the tests and the benchmarks both write: the TOML config writer and the stages on the tiny models.

Standard library only, and no `omnid` import at module level: tests/conftest.py re-exports all of
it for the tests (`from conftest import toml_dumps, tiny_llm, ...`), tests/benchmarks/_harness.py
imports it for the benchmarks (it puts tests/ on sys.path, after the repository root), and
tests/benchmarks/_vllm_step.py, which must import `omnid` from another tree, takes its vLLM
arguments from here too.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "tests" / "fixtures"
EXAMPLES = ROOT / "etc" / "examples"
MODELS = Path(os.environ.get("OMNID_TEST_MODELS", ROOT / ".models"))


# ------------------------------------------------------------------------- TOML writing


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, (str, Path)):
        return json.dumps(str(v))
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{ " + ", ".join(f"{json.dumps(k)} = {_toml_value(x)}" for k, x in v.items()) + " }"
    raise TypeError(f"cannot write {type(v).__name__} as TOML")


def toml_dumps(data: dict[str, dict[str, Any]]) -> str:
    """Top-level tables of tables ([stages.NAME]) or of values ([daemon])."""
    out: list[str] = []
    for section, body in data.items():
        scalars = {k: v for k, v in body.items() if not isinstance(v, dict) or section == "daemon"}
        tables = {k: v for k, v in body.items() if isinstance(v, dict) and section != "daemon"}
        if scalars:
            out.append(f"[{section}]")
            out += [f"{json.dumps(k)} = {_toml_value(v)}" for k, v in scalars.items()]
            out.append("")
        for name, table in tables.items():
            out.append(f"[{section}.{json.dumps(name)}]")
            out += [f"{json.dumps(k)} = {_toml_value(v)}" for k, v in table.items()]
            out.append("")
    return "\n".join(out)


# ------------------------------------------------------------------------- processes


def stop_process(proc: subprocess.Popen[Any], timeout: float, sig: int = signal.SIGTERM) -> bool:
    """Send `sig` to a child that still runs, and reap it; SIGKILL it past `timeout` s. Tells
    whether it exited in time (its status is then `proc.returncode`)."""
    if proc.poll() is None:
        proc.send_signal(sig)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            return False
    return True


# ------------------------------------------------------------------------- raw event streams


def open_event_stream(path: str, job: str) -> socket.socket:
    """An event stream of `job` on the daemon's socket `path`, on a raw Unix socket: answered 200 and
    its first event read; the socket stays open. RefusedStream (with the answer) when it is not."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(30)
    s.connect(path)
    s.sendall(f"GET /v1/jobs/{job}/events HTTP/1.1\r\nHost: omnid\r\n\r\n".encode())
    got = b""
    while True:
        chunk = s.recv(65536)
        if not chunk:
            s.close()
            raise RefusedStream(got)            # (closed: the answer says what came)
        got += chunk
        head, sep, body = got.partition(b"\r\n\r\n")
        if not sep:
            continue
        if head.split(b" ", 2)[1] != b"200":
            m = re.search(rb"(?i)content-length: (\d+)", head)
            if m and len(body) >= int(m.group(1)):
                s.close()
                raise RefusedStream(got)
        elif b"\n" in body:
            break
    return s


class RefusedStream(Exception):
    """An event stream answered other than 200 (`answer`: all that came, head and body)."""

    def __init__(self, answer: bytes) -> None:
        super().__init__(answer[:300])
        self.answer = answer


# ------------------------------------------------------------------------- stages


def python_stage(module: str, function: str, folder: Path | str = FIXTURES, **extra: Any) -> dict[str, Any]:
    """A `python` stage running `module:function`, found in `folder` (tests/fixtures unless said)."""
    return {"engine": "python", "function": f"{module}:{function}", "python_path": [str(folder)], **extra}


def demo_stage(function: str, **extra: Any) -> dict[str, Any]:
    """A python stage of the demo's etc/examples/demo_stages.py (`vocoder`, `frame`)."""
    return python_stage("demo_stages", function, EXAMPLES, **extra)


# vLLM's arguments for the tiny Llama on the CPU: bf16, seeded; a stage adds its own (max_model_len, ...)
# enforce_eager: the suite's stages skip torch.compile (vLLM's default, and omnid's: ~30 s a load
# on these 2 cores); the tests that mean the compiled load say so.
TINY_LLM_ARGS: dict[str, Any] = {"dtype": "bfloat16", "seed": 0, "enforce_eager": True}


def tiny_llm(defaults: dict[str, Any] | None = None, *, max_model_len: int = 512, args: dict[str, Any] | None = None,
             model: Path | str | None = None, engine_core: str = "inline", **extra: Any) -> dict[str, Any]:
    """A vLLM stage on the tiny Llama (MODELS/llm, or `model`: the tiny VLM, ALM, ...) on the CPU.

    `defaults`: the stage's per-job defaults (max_tokens, temperature, ...); `args`: vLLM engine
    arguments beside max_model_len, dtype and seed; `extra`: the stage's other keys (max_inflight, ...).
    `engine_core`: "inline" unless the test is about the engine core's own process (omnid's default,
    "process", which test_engine_core, test_engines, test_vllm_tensors, test_vllm_compile and the omni
    tests run): a core in a process of its own imports torch and vLLM a second time, about 10 CPU
    seconds of each stage's start, a third of it.
    """
    stage: dict[str, Any] = {"engine": "vllm", "model": str(model or MODELS / "llm"), "devices": [],
                             "engine_core": engine_core,
                             "args": {"max_model_len": max_model_len, **TINY_LLM_ARGS, **(args or {})}}
    if defaults is not None:
        stage["defaults"] = dict(defaults)
    return {**stage, **extra}


def tiny_sd(defaults: dict[str, Any] | None = None, **extra: Any) -> dict[str, Any]:
    """A diffusers stage on the tiny Stable Diffusion (MODELS/sd, 64 px) on the CPU."""
    stage: dict[str, Any] = {"engine": "diffusers", "model": str(MODELS / "sd"), "devices": []}
    if defaults is not None:
        stage["defaults"] = dict(defaults)
    return {**stage, **extra}


def build_tiny_models(*names: str) -> None:
    """Build the tiny models (all of them, offline) unless each of `names` is built already."""
    from omnid.tinymodels import is_built
    if not all(is_built(MODELS / name, name) for name in names):
        subprocess.run([sys.executable, "-m", "omnid.tinymodels", str(MODELS)], check=True)


@contextlib.contextmanager
def tmpfs(path: Path, size_mb: int, mode: str | None = None) -> Iterator[Path]:
    """A fresh `size_mb` MiB tmpfs mounted on the folder `path` (made here), unmounted at the end;
    the test is skipped where it cannot be mounted (not root)."""
    path.mkdir(parents=True, exist_ok=True)
    opts = f"size={size_mb}m" + (f",mode={mode}" if mode else "")
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(path)], capture_output=True, text=True)
    if done.returncode != 0:
        import pytest
        pytest.skip(f"cannot mount a tmpfs (needs root): {done.stderr.strip()}")
    try:
        yield path
    finally:
        if subprocess.run(["umount", str(path)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(path)], capture_output=True)
