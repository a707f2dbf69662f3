"""Speech under load: does every listener hear its stream without a gap, and what does the machine
serve on time? (`make bench BENCH_ARGS="--only omni_load"`)

One daemon: the demo's omni pipeline (thinker on vLLM, talker and code2wav sessions stages on the
tiny Qwen2.5-Omni), three times: `omni` with the demo's admission by capacity (overload "queue"),
`omni_open` without it (every stream admitted, as before) and `omni_refuse` (the demo's admission,
overload "refuse"). Each stream is a 128-token answer that its client plays from its first packet on.
Then the same sweep of the demo's `tts` pipeline (a codec LM on vLLM and code2wav; TTS_TOKENS codes,
5 s of audio), in a daemon of its own. The offered load goes from 0.5x to 4x the
pipeline's own capacity estimate (`GET /v1/stages`, `realtime` of the pipeline), the streams arriving
spread over ARRIVAL_S seconds. Per row:
- first packet: submit -> the first audio packet (p50, and the max);
- late packets: packets that arrived after the audio before them had played out (+20 ms);
- at once: the most streams playing at the same time, from first packet to the end of its audio (the
  "concurrent streams with no late packet" figure: the largest of these in a row with no late packet;
  queued streams that played one after another are not concurrent);
- buffer needed: the pre-buffer a player must hold so that it never waits (the max over streams);
- gap-free start: first packet + that buffer (the max over the streams that started);
- audio s / wall s: all streams' audio over the wave's wall time; goodput: the same, counting only
  the streams with no late packet;
- refused (503) and queued streams; the refused ones' answer time (each must carry Retry-After), the
  queued ones' start against the estimate they were given (`refuse` waves at 2x and 4x; queued
  streams of the `queue` ones).
A PNG plot of goodput and late packets against offered load is written beside the JSON rows.
"""

from __future__ import annotations

import math
import time
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from _harness import MODELS, ROOT, Ctx, Daemon, Row, at_least, at_most, fmt, in_threads, kill_daemon, p50
from bench_tensors import _launch

from omnictl.client import ApiError

TOKENS = 128
TTS_TOKENS = 250                # the tts streams: 250 codes, 5 s of audio
CODES_PER_TOKEN = 4
MIN_ESTIMATE_S = 1.0            # a queued stream's start against its estimate: estimates under 1 s count as 1 s
LATE_S = 0.02                   # a packet later than this past its play time is late
ARRIVAL_S = 2.0                 # a wave's streams arrive spread over this long
OUT = Path(__file__).resolve().parents[2] / ".run"      # beside make bench's bench.json
ONE_THREAD = {"OMP_NUM_THREADS": "1"}
LOADS = (0.5, 1.0, 2.0, 4.0)
# The demo's own speech settings (its code2wav ramp, the talker -> code2wav window, the admission), read
# from etc/omnid-demo.toml: what the bench measures is what a newcomer runs.
DEMO = tomllib.loads((ROOT / "etc" / "omnid-demo.toml").read_text())
DEMO_CODE2WAV = DEMO["stages"]["code2wav"]["defaults"]
DEMO_WINDOW = next(e["window"] for e in DEMO["pipelines"]["omni"]["edges"] if e["to"] == "code2wav")
REALTIME: dict[str, Any] = DEMO["pipelines"]["omni"]["realtime"]
TTS_REALTIME: dict[str, Any] = DEMO["pipelines"]["tts"]["realtime"]


def config(realtime: dict[str, Any] | None = None) -> tuple[dict[str, Any], dict[str, Any]]:
    """The demo's omni stages and two pipelines over them: `omni` (admission on: `realtime`) and
    `omni_open` (none)."""
    omni = str(MODELS / "omni")
    stages: dict[str, Any] = {
        "thinker": {"engine": "vllm", "model": omni + "/thinker", "devices": [], "max_inflight": 8,
                    "hidden_prompt": True, "args": {"max_model_len": 512, "dtype": "float32", "seed": 0,
                                                    "enforce_eager": True},
                    "defaults": {"max_tokens": TOKENS, "temperature": 0.0, "ignore_eos": True}},
        "talker": {"engine": "python", "sessions": "omnid.omni.stages:Talker", "model": omni, "max_inflight": 8,
                   "defaults": {"codes_per_token": CODES_PER_TOKEN}, "env": ONE_THREAD},
        "code2wav": {"engine": "python", "sessions": "omnid.omni.stages:Code2Wav", "model": omni,
                     "max_inflight": 8, "defaults": dict(DEMO_CODE2WAV), "env": ONE_THREAD},
    }
    tensors = {"prompt_ids": "prompt_token_ids", "ids": "token_ids", "states": "hidden_states"}
    pipe = {"stages": ["thinker", "talker", "code2wav"], "outputs": {"thinker": ["text"]},
            "edges": [{"from": "thinker", "to": "talker", "window": 1, "map": tensors},
                      {"from": "talker", "to": "code2wav", "window": DEMO_WINDOW, "map": {"codes": "codes"}}],
            "timeout_s": 600}
    return stages, three("omni", pipe, realtime)


def three(name: str, pipe: dict[str, Any], realtime: dict[str, Any] | None) -> dict[str, Any]:
    """The pipeline three times: NAME (admission by `realtime`), NAME_open (none), NAME_refuse
    (`realtime` with overload "refuse")."""
    return {name: {**pipe, "realtime": realtime or {}}, f"{name}_open": dict(pipe),
            f"{name}_refuse": {**pipe, "realtime": {**(realtime or {}), "overload": "refuse"}}}


def tts_config(realtime: dict[str, Any] | None = None) -> tuple[dict[str, Any], dict[str, Any]]:
    """The demo's tts stages (its codec LM and code2wav) and its pipeline three times, as `config`'s."""
    stages = {name: dict(DEMO["stages"][name]) for name in ("tts", "tts_code2wav")}
    for st in stages.values():
        st["model"] = str(MODELS / Path(st["model"]).name)
    stages["tts"]["args"] = {**stages["tts"]["args"], "max_model_len": 512}
    stages["tts"]["defaults"] = {**stages["tts"]["defaults"], "max_tokens": TTS_TOKENS}
    pipe = {k: v for k, v in DEMO["pipelines"]["tts"].items() if k != "realtime"}
    return stages, three("tts", pipe, realtime)


def buffer_needed(packets: list[tuple[float, float]]) -> float:
    """The least pre-buffer (seconds after the first packet) with which a player that then plays
    each packet for its length never waits for one."""
    if not packets:
        return 0.0
    t0, played, need = packets[0][0], 0.0, 0.0
    for ts, seconds in packets:
        need = max(need, ts - t0 - played)
        played += seconds
    return need


def concurrent(streams: list[Stream]) -> int:
    """The most streams playing at once: from first packet to the end of its audio at its listener
    (a queued stream that played after another is not concurrent with it)."""
    edges: list[tuple[float, int]] = []
    for s in streams:
        if s.packets:
            clock = s.packets[0][0]
            for ts, seconds in s.packets:
                clock = max(clock, ts) + seconds
            edges += [(s.packets[0][0], 1), (clock, -1)]
    most = now = 0
    for _, step in sorted(edges, key=lambda e: (e[0], e[1])):     # (an end before a start at the same time)
        now += step
        most = max(most, now)
    return most


def late_packets(packets: list[tuple[float, float]]) -> int:
    """Packets that arrive more than LATE_S after the audio before them has played out (a player
    that starts at the first packet, and waits for a late one)."""
    return len(late_indexes(packets))


def late_indexes(packets: list[tuple[float, float]]) -> list[tuple[int, float]]:
    """(index, seconds late) of each late packet (`late_packets`)."""
    late, clock = [], None
    for i, (ts, seconds) in enumerate(packets):
        if clock is not None and ts > clock + LATE_S:
            late.append((i, round(ts - clock, 3)))
        clock = (max(clock, ts) if clock is not None else ts) + seconds
    return late


@dataclass
class Stream:
    """One client's stream: when it asked, what it heard, whether it was turned away."""

    t0: float
    packets: list[tuple[float, float]] = field(default_factory=list)    # (arrival, audio seconds)
    refused: bool = False
    refused_in_s: float | None = None
    retry_after: str | None = None
    queued: bool = False
    estimate_s: float | None = None         # its estimated start, when it was queued
    started_s: float | None = None          # submit -> its first stage started
    state: str = ""
    job: str = ""

    @property
    def first(self) -> float | None:
        return self.packets[0][0] - self.t0 if self.packets else None

    @property
    def audio_s(self) -> float:
        return sum(s for _, s in self.packets)

    @property
    def late(self) -> int:
        return late_packets(self.packets)


def _stream(d: Daemon, pipeline: str, sink: str, i: int, delay: float) -> Stream:
    time.sleep(delay)
    s = Stream(time.time())
    try:
        job = d.client.submit(pipeline, {"prompt": f"tell me a story number {i}"}, {})
    except ApiError as e:
        s.refused, s.refused_in_s = True, time.time() - s.t0
        s.retry_after = None if e.retry_after is None else str(e.retry_after)
        s.state = "refused"
        return s
    s.job = str(job["id"])
    wait = (job.get("stream") or {})      # (the submit answer's: a waiting stream's place)
    if wait.get("position"):
        s.queued, s.estimate_s = True, wait.get("estimated_start_s")
    for ev in d.follow(str(job["id"]), timeout=600):
        if ev.get("type") == "stage_started" and s.started_s is None:
            s.started_s = float(ev["ts"]) - s.t0
        if ev.get("type") == "segment" and ev.get("stage") == sink and ev.get("audio_s"):
            s.packets.append((float(ev["ts"]), float(ev["audio_s"])))
        if ev.get("type") == "state":
            s.state = str(ev.get("state"))
    return s


@dataclass
class Wave:
    pipeline: str
    offered: int
    wall: float
    streams: list[Stream]

    def served(self) -> list[Stream]:
        return [s for s in self.streams if not s.refused]

    def row(self) -> dict[str, Any]:
        served = [s for s in self.served() if s.packets]
        firsts = [s.first for s in served if s.first is not None]
        buffers = [buffer_needed(s.packets) for s in served]
        audio = sum(s.audio_s for s in served)
        good = sum(s.audio_s for s in served if s.late == 0)
        refused = [s for s in self.streams if s.refused]
        return {"pipeline": self.pipeline, "offered": self.offered,
                "first_p50": p50(firsts) if firsts else None, "first_max": max(firsts) if firsts else None,
                "late": sum(s.late for s in served), "packets": sum(len(s.packets) for s in served),
                "no_gap": sum(1 for s in served if s.late == 0), "served": len(served),
                "concurrent": concurrent(served),
                "buffer_max": max(buffers) if buffers else None,
                "gapfree_max": max((s.first or 0) + b for s, b in zip(served, buffers)) if served else None,
                "audio_per_s": audio / self.wall, "goodput": good / self.wall,
                "refused": len(refused), "refused_ms_max": max((s.refused_in_s or 0) * 1e3 for s in refused)
                if refused else None, "retry_after": all(s.retry_after for s in refused) if refused else None,
                "queued": sum(1 for s in self.streams if s.queued),
                "queued_late_max": max((s.started_s / max(s.estimate_s, MIN_ESTIMATE_S) for s in self.streams
                                        if s.queued and s.started_s is not None and s.estimate_s is not None),
                                       default=None),
                "failed": sum(1 for s in self.served() if s.state != "succeeded")}


def wave(d: Daemon, pipeline: str, n: int, sink: str = "code2wav") -> Wave:
    t0 = time.monotonic()
    streams = in_threads(n, lambda i: _stream(d, pipeline, sink, i, ARRIVAL_S * i / max(1, n)), timeout=900)
    for s in streams:
        if isinstance(s, BaseException):
            raise s
    return Wave(pipeline, n, time.monotonic() - t0, streams)


def capacity(d: Daemon, pipeline: str = "omni") -> dict[str, Any]:
    """The pipeline's own capacity figures (`GET /v1/pipelines`' realtime, as `omnictl stages` shows)."""
    for p in d.client.pipelines()["pipelines"]:
        if p["name"] == pipeline:
            return dict(p.get("realtime") or {})
    return {}


def _mode(pipeline: str) -> str:
    return "off" if pipeline.endswith("_open") else "refuse" if pipeline.endswith("_refuse") else "on"


def measured(d: Daemon, pipeline: str, before: dict[str, Any], timeout: float = 12.0) -> dict[str, Any]:
    """The capacity once the pipeline's meter has measured the stream that just ran (its window is
    8 s: a stream shorter than that is counted a few seconds after it ended)."""
    deadline = time.monotonic() + timeout
    cap = capacity(d, pipeline)
    while cap.get("audio_per_s") == before.get("audio_per_s") and time.monotonic() < deadline:
        time.sleep(0.5)
        cap = capacity(d, pipeline)
    return cap


def plot(rows: list[dict[str, Any]], peak: float, path: Path, title: str) -> None:
    """Goodput and late packets against offered load (x capacity), admission on and off."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    for mode, label in (("on", "admission on"), ("off", "admission off")):
        rs = [r for r in rows if _mode(r["pipeline"]) == mode]
        xs = [r["load"] for r in rs]
        a.plot(xs, [r["goodput"] for r in rs], marker="o", label=label)
        b.plot(xs, [100 * r["late"] / max(1, r["packets"]) for r in rs], marker="o", label=label)
    a.axhline(peak, color="grey", linestyle=":", label="peak goodput")
    a.set(xlabel="offered load (x measured capacity)", ylabel="goodput (audio s/s, streams with no gap)",
          title="Goodput")
    b.set(xlabel="offered load (x measured capacity)", ylabel="late packets (%)", title="Late packets")
    for ax in (a, b):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def table(rows: list[dict[str, Any]]) -> str:
    head = ["admission", "offered", "x cap", "1st p50", "1st max", "late/packets", "no gap", "at once", "buffer max",
            "gap-free start max", "audio s/s", "goodput", "refused (ms max)", "queued (start / estimate, max)",
            "failed"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        queued = str(r["queued"]) + (f" ({r['queued_late_max']:.2f}x)" if r.get("queued_late_max") else "")
        lines.append("| " + " | ".join([
            _mode(r["pipeline"]), str(r["offered"]), f"{r['load']:g}", fmt(r["first_p50"], "s"),
            fmt(r["first_max"], "s"), f"{r['late']} / {r['packets']}", f"{r['no_gap']} of {r['served']}", str(r.get("concurrent", "")),
            fmt(r["buffer_max"], "s"), fmt(r["gapfree_max"], "s"), fmt(r["audio_per_s"]), fmt(r["goodput"]),
            f"{r['refused']}" + (f" ({r['refused_ms_max']:.0f})" if r["refused"] else ""), queued,
            str(r["failed"])]) + " |")
    return "\n".join(lines)


@dataclass
class Sweep:
    """One real-time pipeline's sweep: its name (`omni`, `tts`), its sink stage, its rows."""

    name: str
    sink: str
    lone: dict[str, Any]
    rows: list[dict[str, Any]]
    cap: dict[str, Any]


def sweep(ctx: Ctx, d: Daemon, name: str, sink: str, loads: tuple[float, ...]) -> Sweep:
    """A lone stream, then each load with admission on and off (and refusing, from 2x on)."""
    ready = capacity(d, name)
    ctx.log(f"{name}: capacity when ready: {ready}")
    lone = wave(d, name, 1, sink).row()
    lone["load"] = 0.0
    ctx.log(f"{name}: lone stream: {lone}")
    cap = measured(d, name, ready)
    streams = max(1, int(cap["streams"])) if cap.get("streams") is not None else 4
    ctx.log(f"{name}: capacity after a stream: {cap}")
    rows: list[dict[str, Any]] = []
    for load in loads:
        n = max(1, math.ceil(load * streams))
        for pipeline in (name, f"{name}_open", *([f"{name}_refuse"] if load >= 2.0 else [])):
            ctx.check(f"{pipeline} x{load}")
            w = wave(d, pipeline, n, sink)
            r = w.row()
            r["load"] = load
            late = {i: late_indexes(st.packets) for i, st in enumerate(w.streams) if st.late}
            if late:
                ctx.log(f"{pipeline} {n} streams, late packets (stream: (index, s late)): {late}")
            rows.append(r)
            ctx.log(f"{pipeline} {n} streams: {r}")
            d.drain(120)
    return Sweep(name, sink, lone, rows, capacity(d, name))


def report(ctx: Ctx, s: Sweep, title: str) -> list[Row]:
    """The sweep's plot and table (.run/NAME_load.png, .md), and its rows against the goals."""
    OUT.mkdir(exist_ok=True)
    lone, rows, cap, tag = s.lone, s.rows, s.cap, f"{s.name}_load"
    shown = [r for r in rows if _mode(r["pipeline"]) != "refuse"]
    peak = max((r["goodput"] for r in shown), default=0.0)
    plot(shown, peak, OUT / f"{tag}.png", title)
    (OUT / f"{tag}.md").write_text(table([lone] + rows) + "\n")
    ctx.log("\n" + table([lone] + rows))
    ctx.log(f"plot and table: {OUT / f'{tag}.png'}, {OUT / f'{tag}.md'}")
    within = next((r for r in rows if r["pipeline"] == s.name and r["load"] == 1.0), None)
    over = [r for r in rows if r["pipeline"] == s.name and r["load"] >= 2.0]
    most_on_time = max((r["concurrent"] for r in rows if r["late"] == 0), default=0)
    result = [
        Row(f"{tag}: a lone stream's gap-free start", lone["gapfree_max"], "s", "its first packet",
            lone["first_p50"], "s", (lone["gapfree_max"] or 0) / (lone["first_p50"] or 1), "gap-free / first",
            at_most(1.2, "<= 1.2x"), f"late packets {lone['late']} of {lone['packets']} (goal 0)"),
        Row(f"{tag}: concurrent streams with no late packet", float(most_on_time), "streams",
            "the capacity the pipeline measured", float(cap.get("audio_per_s") or 0), "audio s/s",
            most_on_time / max(1e-9, float(cap.get("audio_per_s") or 0)), "streams / measured audio s/s",
            at_least(0.8, ">= 0.8x"), f"capacity {cap}"),
    ]
    if within:
        result.append(Row(f"{tag}: within capacity, slowest gap-free start", within["gapfree_max"], "s",
                          "a lone stream's", lone["gapfree_max"], "s",
                          (within["gapfree_max"] or 0) / max(1e-9, lone["gapfree_max"] or 0), "within / lone",
                          at_most(2.0, "<= 2x"), f"{within['offered']} streams, late {within['late']} of "
                          f"{within['packets']} (goal 0)"))
    for r in over:
        result.append(Row(f"{tag}: goodput at {r['load']:g}x capacity, admission on", r["goodput"], "audio s/s",
                          "the peak goodput of the sweep", peak, "audio s/s", r["goodput"] / max(1e-9, peak),
                          "goodput / peak", at_least(0.9, ">= 0.9x"),
                          f"late {r['late']} of {r['packets']} (goal <= 1 %), queued {r['queued']}, "
                          f"refused {r['refused']}"))
    refusing = next((r for r in rows if _mode(r["pipeline"]) == "refuse" and r["load"] == max(LOADS)), None)
    if refusing is not None and refusing["refused"]:
        result.append(Row(f"{tag}: refused streams' answer at {refusing['load']:g}x capacity, slowest",
                          refusing["refused_ms_max"] / 1e3, "s", "the goal's 20 ms", 0.02, "s",
                          refusing["refused_ms_max"] / 20.0, "refusal / 20 ms", at_most(1.0, "<= 1.0x"),
                          f"{refusing['refused']} refused of {refusing['offered']}, each with Retry-After: "
                          f"{refusing['retry_after']}; admitted: late {refusing['late']} of {refusing['packets']}",
                          error=None if refusing["retry_after"] else "a refused stream's answer had no Retry-After"))
    queued = [r["queued_late_max"] for r in rows if r.get("queued_late_max") is not None]
    if queued:
        result.append(Row(f"{tag}: queued streams' start against their estimate, slowest", max(queued), "x",
                          "their estimate", 1.0, "x", max(queued), "start / estimate", at_most(1.5, "<= 1.5x"),
                          f"queued streams in {len(queued)} waves (estimates under {MIN_ESTIMATE_S:g} s count "
                          f"as {MIN_ESTIMATE_S:g} s)"))
    return result


def swept(ctx: Ctx, daemon: tuple[dict[str, Any], dict[str, Any]], name: str, sink: str) -> Sweep:
    """`sweep` in a daemon of its own (stages, pipelines), stopped after."""
    d = _launch(*daemon)
    try:
        return sweep(ctx, d, name, sink, LOADS if not ctx.quick else (1.0, 2.0))
    finally:
        kill_daemon(d)


def bench_omni_load(ctx: Ctx) -> list[Row]:
    omni = swept(ctx, config(REALTIME), "omni", "code2wav")
    result = report(ctx, omni, "omni speech under load (tiny Qwen2.5-Omni, 2 CPU cores, 128-token answers)")
    if ctx.quick:
        return result
    tts = swept(ctx, tts_config(TTS_REALTIME), "tts", "tts_code2wav")
    return result + report(ctx, tts, f"tts speech under load (tiny codec LM, 2 CPU cores, {TTS_TOKENS} codes)")


FIGURES = [f"{tag}_load: {what}" for tag in ("omni", "tts") for what in (
    "a lone stream's gap-free start", "concurrent streams with no late packet",
    "within capacity, slowest gap-free start",
    *[f"goodput at {x:g}x capacity, admission on" for x in LOADS if x >= 2.0],
    f"refused streams' answer at {max(LOADS):g}x capacity, slowest",
    "queued streams' start against their estimate, slowest")]
