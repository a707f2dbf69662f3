"""vLLM stages that speak tensors: what the hidden-state tap costs, and how early a stream of
hidden states reaches its consumer.

The tap's cost per decode step is measured in one process (_tap_step.py: one engine with the tap,
batches that ask for rows alternating with batches that ask for nothing). The streams run on a
daemon of its own: the tiny Llama on vLLM (CPU), `tapped` (`outputs = ["hidden_states",
"token_ids"]`: every job's rows come out), and python consumers of hidden states (`_stages.consume_states`) behind a
`window = 8`, a `window = -1` and a `window = [2, 8]` edge out of `tapped`. For the row against
today's main, omnid's engine for a stage nothing asks tensors of runs from this tree's HEAD and
from main's code (`git archive`, the ref in OMNID_BENCH_BASE, default "main"; _plain_step.py), one
process each, their batches alternating.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _harness import (
    BENCH_DAEMON,
    MODELS,
    ROOT,
    Ctx,
    Daemon,
    Row,
    at_most,
    fmt,
    kill_daemon,
    p50,
    py_stage,
    short_tmpdir,
    toml_dumps,
    vllm_stage,
    wait_ready,
)

TOKENS = 64
BATCH = 4
PROMPT = "a lighthouse on a cliff at dusk"


def _config() -> tuple[dict[str, Any], dict[str, Any]]:
    stages = {"tapped": vllm_stage(max_inflight=BATCH, outputs=["hidden_states", "token_ids"]),
              **{name: py_stage("consume_states") for name in ("down8", "downall", "downramp")}}
    pipelines: dict[str, Any] = {}
    for name, window in (("down8", 8), ("downall", -1), ("downramp", [2, 8])):
        pipelines[name] = {"stages": ["tapped", name],
                           "edges": [{"from": "tapped", "to": name, "window": window,
                                      "map": {"states": "hidden_states"}}]}
    return stages, pipelines


def _launch(stages: dict[str, Any], pipelines: dict[str, Any], timeout: float = 300) -> Daemon:
    """As _harness.start_daemon, with a longer wait for readiness (vLLM loading on a busy machine)."""
    d = short_tmpdir()
    cfg = {"daemon": {"socket": str(d / "omnid.sock"), "state_dir": str(d / "state"),
                      "lock_dir": str(d / "lock"), **BENCH_DAEMON}, "stages": stages, "pipelines": pipelines}
    (d / "omnid.toml").write_text(toml_dumps(cfg))
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    with open(d / "omnid.log", "ab") as log:
        t, wall = time.monotonic(), time.time()
        proc = subprocess.Popen([sys.executable, "-m", "omnid", "-c", str(d / "omnid.toml")], stdout=log,
                                stderr=subprocess.STDOUT, env=env, cwd=str(d))
    daemon = Daemon(proc, d, d / "omnid.sock", d / "omnid.log", t, wall)
    try:
        wait_ready(daemon, timeout)
    except BaseException:
        kill_daemon(daemon)
        raise
    return daemon


def _first_window_s(d: Daemon, pipeline: str) -> tuple[float, int]:
    """Submit -> the consumer's first segment (s), and its segment count."""
    r = d.run(pipeline, {"prompt": PROMPT}, {"tapped": {"max_tokens": TOKENS}}, timeout=120).check()
    segs = r.all(type="segment", stage=pipeline)
    return float(segs[0]["ts"]) - r.t0, len(segs)


def _baseline_tree(ref: str) -> Path:
    """`ref`'s omnid package, unpacked in a temporary folder (nothing in the repository changes)."""
    folder = Path(tempfile.mkdtemp(prefix="omnid-base-"))
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", ref, "omnid"], capture_output=True, check=True)
    subprocess.run(["tar", "-x", "-C", str(folder)], input=archive.stdout, check=True)
    return folder


def _tap_cost(ctx: Ctx, rounds: int) -> tuple[list[float], list[float]]:
    """ms per decode step with the tap's rows asked and not, on one engine in one process (_tap_step.py)."""
    script = Path(__file__).resolve().parent / "_tap_step.py"
    out = subprocess.run([sys.executable, str(script), str(MODELS / "llm"), str(rounds), str(BATCH), str(TOKENS)],
                         capture_output=True, text=True, timeout=max(30.0, ctx.left()), cwd=str(ROOT))
    if out.returncode != 0:
        raise RuntimeError(f"_tap_step.py exited {out.returncode}: {out.stderr[-500:]}")
    # (vLLM's own shutdown logs to stdout too, after the figures: the line that holds them)
    times = json.loads(next(line for line in reversed(out.stdout.splitlines()) if line.startswith('{"on"')))
    return list(times["on"]), list(times["off"])


def bench_tap_cost(ctx: Ctx) -> list[Row]:
    on, off = _tap_cost(ctx, ctx.n(7, 3))
    return [Row(f"vLLM decode step, {BATCH} jobs: hidden-state tap + token_ids on", p50(on), "ms CPU",
                "same engine, same process, nothing asked", p50(off), "ms CPU", p50(on) / p50(off), "on / off",
                at_most(1.1, "<= 1.1x"), f"median of {len(on)} alternating batches of {BATCH} x {TOKENS} tokens; "
                f"on {fmt(min(on))}..{fmt(max(on))} ms, off {fmt(min(off))}..{fmt(max(off))} ms")]


def bench_tensor_streams(ctx: Ctx) -> list[Row]:
    runs = ctx.n(4, 2)
    d = _launch(*_config())
    try:
        first: dict[str, list[float]] = {"down8": [], "downall": [], "downramp": []}
        windows: dict[str, int] = {}
        for i in range(runs + 1):
            for pipeline in first:
                ctx.check(f"first window, run {i} of {pipeline}")
                t, n = _first_window_s(d, pipeline)
                windows[pipeline] = n
                if i:
                    first[pipeline].append(t)
    finally:
        d.stop()
    return [
        Row("hidden-state stream: submit -> 1st consumer window, window 8", 1000 * p50(first["down8"]), "ms",
            "same, window -1", 1000 * p50(first["downall"]), "ms", p50(first["down8"]) / p50(first["downall"]),
            "w8 / w-1", at_most(0.2, "<= 0.2x"),
            f"median of {runs}; {TOKENS} tokens; {windows['down8']} windows per w8 job"),
        Row("hidden-state stream: submit -> 1st consumer window, window [2, 8]", 1000 * p50(first["downramp"]), "ms",
            "same, window 8", 1000 * p50(first["down8"]), "ms", p50(first["downramp"]) / p50(first["down8"]),
            "ramp / w8", at_most(1.0, "< 1x"),
            f"median of {runs}; {windows['downramp']} windows per ramp job"),
    ]


def bench_no_tensor_edge(ctx: Ctx) -> list[Row]:
    return [_against_main(ctx, ctx.n(10, 4))]


def _against_main(ctx: Ctx, runs: int) -> Row:
    """A stage nothing asks tensors of, on this tree vs on main (_plain_step.py, two processes, batches
    alternating): what tensors cost when unasked."""
    figure = "vLLM decode step, no tensor edge: this tree"
    ref = os.environ.get("OMNID_BENCH_BASE", "main")
    try:
        # Both sides unpacked the same way (this tree as committed: HEAD), so nothing but the code differs
        mine, base = _baseline_tree("HEAD"), _baseline_tree(ref)
    except (subprocess.CalledProcessError, OSError) as e:
        return Row(figure, error=f"cannot unpack HEAD or {ref!r}: {e}")
    script = Path(__file__).resolve().parent / "_plain_step.py"
    procs: dict[str, subprocess.Popen[str]] = {}
    times: dict[str, list[float]] = {"tree": [], "base": []}
    try:
        for side, tree in (("tree", mine), ("base", base)):
            env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
            procs[side] = subprocess.Popen([sys.executable, str(script), str(tree), str(MODELS / "llm"), str(BATCH),
                                            str(TOKENS)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                           stderr=subprocess.DEVNULL, text=True, env=env, cwd=str(tree))
        for side, proc in procs.items():
            ready = json.loads(_line(proc, side))
            if not ready.get("ready"):
                raise RuntimeError(f"{side}: {ready}")
            ctx.log(f"{side}: omnid from {ready.get('from')}")
        for i in range(runs + 1):
            order = list(procs.items())
            for side, proc in (order if i % 2 else order[::-1]):      # who goes first flips every round
                ctx.check(f"against {ref}, run {i} of {side}")
                assert proc.stdin is not None
                proc.stdin.write("go\n")
                proc.stdin.flush()
                ms = float(json.loads(_line(proc, side))["ms"])
                if i:
                    times[side].append(ms)
    finally:
        for proc in procs.values():
            if proc.stdin is not None:
                proc.stdin.close()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
        subprocess.run(["rm", "-rf", str(mine), str(base)], check=False)
    ours, theirs = p50(times["tree"]), p50(times["base"])
    return Row(figure, ours, "ms CPU", f"the same on {ref}", theirs, "ms CPU", ours / theirs, f"tree / {ref}",
               at_most(1.05, "<= 1.05x (noise)"),
               f"median of {runs} alternating batches of {BATCH} x {TOKENS} tokens, one engine per tree; tree "
               f"{fmt(min(times['tree']))}..{fmt(max(times['tree']))}, {ref} "
               f"{fmt(min(times['base']))}..{fmt(max(times['base']))} ms")


def _line(proc: subprocess.Popen[str], side: str) -> str:
    """The script's next JSON line (vLLM's own log lines on stdout are skipped)."""
    assert proc.stdout is not None
    while True:
        line = proc.stdout.readline()
        if not line:
            raise RuntimeError(f"_plain_step.py ({side}) exited {proc.wait()}")
        if line.startswith("{"):
            return line
