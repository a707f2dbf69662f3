"""What OpenTelemetry tracing costs a chat: throughput and the first token's time, on and off.

Pairs of daemons with the same tiny-vLLM `chat` stage (max_inflight 8, 64 greedy tokens): one with
`[daemon] tracing` on (sample 1.0) exporting to a live OTLP/HTTP receiver (an aiohttp app in a
process of its own, that decodes and counts the spans), one with tracing off. They run one after
the other, alternating, never at once, two runs each; then the pair is stopped and a fresh pair
started (PAIRS in all): two daemons of the same config differ by up to 5 % in throughput on a
2-core host (measured), so one pair alone would say more of its two instances than of tracing.
- Throughput: 128 jobs submitted at once, 128 / wall (before the first POST to the last terminal
  event). The wall (about 2.5 s) is longer than the exporters' period (1 s), so the traced
  daemon's exports of its own spans fall inside it, as under a steady load.
- The first token: one job at a time, submit -> its first segment event, the p50 of each run's
  jobs; measured once the spans of the throughput run before it are handed over and mostly
  exported (a pause of 1.5 s after each wall, for both daemons), so that it is a lone job's
  figure, not the end of a burst's.
Both are the median over the runs (the runs are in the notes). The third row depends less on what
else the machine runs: the CPU seconds the daemon's processes (supervisor, workers and their
exporter processes) spent per throughput job, on / off, the pause after the wall included (the
exports of its spans).
"""

from __future__ import annotations

import socket
import subprocess
import sys
import time
import urllib.request
from typing import Any

from _harness import Ctx, Daemon, Row, at_least, at_most, fmt, kill_daemon, p50, start_daemon, vllm_stage

from omnid.process_stats import tree_cpu_seconds

JOBS = 128              # a throughput run's jobs: its wall spans a few export periods
PAIRS = 4               # fresh daemon pairs (two daemons of one config differ by up to 5 %: each pair is a draw)
EXPORTED_S = 1.5        # a wall's spans have reached the exporter processes and mostly gone by then
                        # (handed over every 0.5 s, exported every 1 s; in processes of their own)

FIGURES = ["chat 128 x 64 tokens, tracing on (sample 1.0, live receiver): jobs/s",
           "chat first token, tracing on: submit -> first segment, p50",
           "chat CPU seconds per job (supervisor and workers), tracing on"]


_RECEIVER = """
import sys
from aiohttp import web
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2 as pb
spans = 0

async def traces(request):
    global spans
    req = pb.ExportTraceServiceRequest()
    req.ParseFromString(await request.read())
    spans += sum(len(ss.spans) for rs in req.resource_spans for ss in rs.scope_spans)
    return web.Response(body=pb.ExportTraceServiceResponse().SerializeToString(), content_type="application/x-protobuf")

async def count(request):
    return web.Response(text=str(spans))

app = web.Application()
app.router.add_post("/v1/traces", traces)
app.router.add_get("/count", count)
web.run_app(app, host="127.0.0.1", port=int(sys.argv[1]), print=None)
"""


class _Receiver:
    """An OTLP/HTTP receiver (POST /v1/traces) in a process of its own (not competing with this
    one's client threads): decodes each request and counts its spans (GET /count)."""

    def __init__(self) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = int(s.getsockname()[1])
        self.proc = subprocess.Popen([sys.executable, "-c", _RECEIVER, str(self.port)])
        deadline = time.monotonic() + 30
        while self.count() is None:
            if time.monotonic() > deadline or self.proc.poll() is not None:
                raise RuntimeError("the OTLP receiver did not start")
            time.sleep(0.05)

    def count(self) -> int | None:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/count", timeout=5) as r:
                return int(r.read())
        except OSError:
            return None

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(10)


def _daemon(tracing: dict[str, Any] | None) -> Daemon:
    stage = vllm_stage(max_inflight=8)
    stage["defaults"] = {**stage["defaults"], "max_tokens": 64}
    return start_daemon({"chat": stage}, {"chat": {"stages": ["chat"]}},
                        {"tracing": tracing} if tracing else None, timeout=300)


def _wall(ctx: Ctx, d: Daemon, n: int) -> float:
    t0 = time.time()
    jobs = [d.submit("chat", {"prompt": f"Tell me about the sea, {i}"}) for i in range(n)]
    ends = []
    for job in jobs:
        end = d.events(job, timeout=min(120.0, max(10.0, ctx.left())))[-1]
        if end.get("state") != "succeeded":
            raise RuntimeError(f"job {job} ended {end}")
        ends.append(float(end["ts"]))
    return max(ends) - t0


def _cpu(d: Daemon) -> float:
    """CPU seconds (user and system) the daemon and its workers have spent so far."""
    return tree_cpu_seconds(d.proc.pid)


def _first_token(ctx: Ctx, d: Daemon) -> float:
    run = d.run("chat", {"prompt": "Once upon a time"}, timeout=min(60.0, max(10.0, ctx.left())))
    return float(run.first(type="segment")["ts"]) - run.t0


def bench_tracing(ctx: Ctx) -> list[Row]:
    receiver = _Receiver()
    live: list[Daemon] = []
    walls: dict[str, list[float]] = {"on": [], "off": []}
    firsts: dict[str, list[float]] = {"on": [], "off": []}     # each run's p50
    cpu: dict[str, list[float]] = {"on": [], "off": []}        # CPU seconds per job, each run
    try:
        for pair in range(ctx.n(PAIRS, 1)):
            ctx.check(f"pair {pair}")
            configs = [{"otlp_endpoint": f"http://127.0.0.1:{receiver.port}", "sample": 1.0}, None]
            for tracing in configs if pair % 2 == 0 else configs[::-1]:     # each starts first in half the pairs
                live.append(_daemon(tracing))
            on, off = live if pair % 2 == 0 else live[::-1]
            ctx.deadline += (on.ready_s or 0) + (off.ready_s or 0)     # (the starts are not the figure's time)
            for d in (on, off):
                _wall(ctx, d, 4)                    # warm both
            for i in range(ctx.n(2, 2)):
                ctx.check(f"pair {pair}, run {i}")
                for name, d in (("on", on), ("off", off)) if (pair + i) % 2 == 0 else (("off", off), ("on", on)):
                    c0 = _cpu(d)
                    walls[name].append(_wall(ctx, d, JOBS))
                    time.sleep(EXPORTED_S)          # its spans go (their CPU counted), before the first tokens
                    cpu[name].append((_cpu(d) - c0) / JOBS)
                    firsts[name].append(p50([_first_token(ctx, d) for _ in range(ctx.n(6, 3))]))
                ctx.log(f"pair {pair} run {i}: walls on {walls['on'][-1]:.2f} s, off {walls['off'][-1]:.2f} s; "
                        f"CPU/job on {cpu['on'][-1] * 1000:.1f} ms, off {cpu['off'][-1] * 1000:.1f} ms")
            time.sleep(1.5)                         # the last batches export
            for d in (on, off):
                kill_daemon(d)
            live.clear()
        tput_on, tput_off = JOBS / p50(walls["on"]), JOBS / p50(walls["off"])
        ttft_on, ttft_off = p50(firsts["on"]), p50(firsts["off"])
        cpu_on, cpu_off = p50(cpu["on"]), p50(cpu["off"])
        spans = receiver.count() or 0
    finally:
        for d in live:
            kill_daemon(d)
        receiver.stop()
    if spans == 0:
        raise RuntimeError("the receiver got no spans from the traced daemon")
    return [Row(FIGURES[0], tput_on, "/s", "same, tracing off", tput_off, "/s", tput_on / tput_off, "on / off",
                at_least(0.97, ">= 0.97x"),
                f"{spans} spans received; walls on {', '.join(fmt(x) for x in walls['on'])} s, "
                f"off {', '.join(fmt(x) for x in walls['off'])} s"),
            Row(FIGURES[1], ttft_on, "s", "same, tracing off", ttft_off, "s", ttft_on / ttft_off, "on / off",
                at_most(1.05, "<= 1.05x"), f"runs' p50s: on {', '.join(fmt(x) for x in firsts['on'])} s, "
                f"off {', '.join(fmt(x) for x in firsts['off'])} s"),
            Row(FIGURES[2], cpu_on, "s", "same, tracing off", cpu_off, "s", cpu_on / cpu_off, "on / off",
                at_most(1.03, "<= 1.03x"), f"per run: on {', '.join(fmt(x) for x in cpu['on'])} s, "
                f"off {', '.join(fmt(x) for x in cpu['off'])} s")]
