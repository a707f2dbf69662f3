"""The peer row: vLLM's own benchmark client against `vllm serve`, then against omnid's TCP listener.

`vllm bench serve` (vLLM's client, through _vllm_cli.py) sends the same chat load to two servers
of the same tiny Llama, one server up at a time (`vllm serve`'s CPU worker spins even when idle,
and slows whatever runs beside it):

- `vllm serve .models/llm --max-num-seqs C`;
- omnid with one `chat` pipeline of one vLLM stage, `max_inflight = C` and `max_num_seqs = C`,
  torch.compile'd as `vllm serve` compiles it (vLLM's default and omnid's), reached on `daemon.listen` with an API key (the client sends OPENAI_API_KEY as a Bearer key).

The load: 64 prompts (128 at C = 64) of the random dataset, 32 tokens in and 64 out, `--ignore-eos`, at most C
requests at once, for C in 16 and 64. Rounds alternate the two servers (vLLM, omnid, vLLM, ...);
each row gives omnid's median, vLLM's median, and the median of the per-round ratios omnid/vLLM
with their range. Three rounds (one with --quick). Rows: request throughput, TTFT p50 and p99,
TPOT p50 and ITL p99.

Runs in the bench runner's thread; it blocks on the servers' start and on the client's runs.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

from _harness import BENCH_DIR, MODELS, VLLM_ARGS, Ctx, Goal, Row, at_least, at_most, kill_daemon, start_daemon, tiny_llm

CLI = BENCH_DIR / "_vllm_cli.py"
CONCURRENCY = (16, 64)
INPUT_LEN, OUTPUT_LEN = 32, 64


def prompts(concurrency: int) -> int:
    """Chats per run: two waves at least (64 at concurrency 16, 128 at 64)."""
    return max(64, 2 * concurrency)

ENV = {"VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_KVCACHE_SPACE": "1"}
ROUND_S = 400           # what one round (two server starts, two client runs) may take on a busy machine
# (row name, result key, unit, higher is better, the goal on omnid / vLLM)
METRICS: tuple[tuple[str, str, str, bool, Goal | None], ...] = (
    ("request throughput", "request_throughput", "req/s", True, at_least(1.0, ">= 1.0x")),
    ("TTFT p50", "median_ttft_ms", "ms", False, at_most(1.0, "stays ahead")),
    ("TTFT p99", "p99_ttft_ms", "ms", False, at_most(1.0, "<= 1.0x")),
    ("TPOT p50", "median_tpot_ms", "ms", False, None),
    ("ITL p99", "p99_itl_ms", "ms", False, at_most(1.2, "<= 1.2x")))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_http(url: str, proc: subprocess.Popen[bytes] | None, timeout: float, what: str, log: Path) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode}: {log.read_text(errors='replace')[-2000:]}")
        try:
            with urllib.request.urlopen(url, timeout=5) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"{what} not up after {timeout:g} s: {log.read_text(errors='replace')[-2000:]}")


def _client(ctx: Ctx, port: int, concurrency: int, key: str | None, tag: str) -> dict[str, Any]:
    out = ctx.scratch(f"{tag}.json")
    log = ctx.scratch(f"{tag}.log")
    env = {**os.environ, **ENV}
    env.pop("OPENAI_API_KEY", None)
    if key is not None:
        env["OPENAI_API_KEY"] = key             # vLLM's client sends it as "Authorization: Bearer KEY"
    cmd = [sys.executable, str(CLI), "bench", "serve", "--backend", "openai-chat",
           "--base-url", f"http://127.0.0.1:{port}", "--endpoint", "/v1/chat/completions", "--model", "chat",
           "--tokenizer", str(MODELS / "llm"), "--dataset-name", "random", "--random-input-len", str(INPUT_LEN),
           "--random-output-len", str(OUTPUT_LEN), "--num-prompts", str(prompts(concurrency)), "--max-concurrency",
           str(concurrency), "--ignore-eos", "--percentile-metrics", "ttft,tpot,itl,e2el",
           "--metric-percentiles", "50,99", "--save-result", "--result-dir", str(out.parent),
           "--result-filename", out.name]
    with open(log, "wb") as f:
        done = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, timeout=max(60.0, ctx.left()))
    if done.returncode != 0:
        raise RuntimeError(f"vllm bench serve ({tag}) exited {done.returncode}: "
                           f"{log.read_text(errors='replace')[-1500:]}")
    result: dict[str, Any] = json.loads(out.read_text())
    if result.get("completed") != prompts(concurrency):
        raise RuntimeError(f"{tag}: {result.get('completed')} of {prompts(concurrency)} requests completed")
    return result


def _vllm_round(ctx: Ctx, concurrency: int, tag: str) -> dict[str, Any]:
    port = _free_port()
    log = ctx.scratch(f"{tag}-serve.log")
    with open(log, "wb") as f:
        proc = subprocess.Popen([sys.executable, str(CLI), "serve", str(MODELS / "llm"), "--served-model-name", "chat",
                                 "--max-model-len", str(VLLM_ARGS["max_model_len"]), "--dtype", VLLM_ARGS["dtype"],
                                 "--seed", "0", "--max-num-seqs", str(concurrency), "--port", str(port),
                                 "--host", "127.0.0.1"],
                                stdout=f, stderr=subprocess.STDOUT, env={**os.environ, **ENV},
                                start_new_session=True)
    try:
        _wait_http(f"http://127.0.0.1:{port}/health", proc, 240, "vllm serve", log)
        return _client(ctx, port, concurrency, None, tag)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(30)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


def _omnid_round(ctx: Ctx, concurrency: int, tag: str) -> dict[str, Any]:
    port = _free_port()
    # compiled, as `vllm serve` runs it (the bench's other vLLM stages run eager, as their anchors do)
    stage = tiny_llm(max_inflight=concurrency, queue_capacity=concurrency,
                     args={"max_num_seqs": concurrency, "enforce_eager": False},
                     env={"VLLM_CPU_KVCACHE_SPACE": ENV["VLLM_CPU_KVCACHE_SPACE"]})
    d = start_daemon({"chat": stage}, {"chat": {"stages": ["chat"]}}, {"listen": [f"127.0.0.1:{port}"]})
    try:
        key = str(d.client.add_key("bench", 0)["key"])
        return _client(ctx, port, concurrency, key, tag)
    finally:
        kill_daemon(d)


def bench_peer(ctx: Ctx) -> list[Row]:
    rounds = ctx.n(3, 1)
    rows: list[Row] = []
    for c in CONCURRENCY:
        peer: list[dict[str, Any]] = []
        ours: list[dict[str, Any]] = []
        for r in range(rounds):
            if r and ctx.left() < ROUND_S:
                ctx.log(f"concurrency {c}: {r} round(s) only, the budget is nearly spent")
                break
            ctx.check(f"round {r + 1} at concurrency {c}")
            ctx.log(f"concurrency {c}, round {r + 1}/{rounds}: vllm serve")
            peer.append(_vllm_round(ctx, c, f"vllm-c{c}-r{r}"))
            ctx.log(f"concurrency {c}, round {r + 1}/{rounds}: omnid")
            ours.append(_omnid_round(ctx, c, f"omnid-c{c}-r{r}"))
        for name, key, unit, higher, goal in METRICS:
            ratios = [o[key] / p[key] for o, p in zip(ours, peer) if p.get(key)]
            rows.append(Row(
                f"peer: {name}, concurrency {c} ({prompts(c)} chats, 32 in / 64 out)",
                value=statistics.median(o[key] for o in ours), unit=unit,
                anchor="vllm serve, same load", anchor_value=statistics.median(p[key] for p in peer),
                anchor_unit=unit, ratio=statistics.median(ratios) if ratios else None, ratio_def="omnid / vLLM",
                goal=goal,
                note=(f"median of {len(ratios)} alternating round(s); ratio range {min(ratios):.2f}-{max(ratios):.2f}; "
                      f"{'higher' if higher else 'lower'} is better") if ratios else ""))
    return rows


FIGURES = [f"peer: {name}, concurrency {c} ({prompts(c)} chats, 32 in / 64 out)" for c in CONCURRENCY for name, *_ in METRICS]
