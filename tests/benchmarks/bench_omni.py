"""Omni speech: how early the first audio comes, and whether the speech keeps up.

One daemon of its own: the tiny Qwen2.5-Omni as the demo runs it (thinker on vLLM, talker and
code2wav python stages on transformers' classes), wired twice: `omni` streams (window 1 into the
talker, a ramp [4, 8, 16, 25] into code2wav) and `omni_whole` waits at each edge (window -1); and
the codec LM, `tts` (ramp [4, ...]) and `tts25` (fixed 25). The first audio packet is code2wav's
first segment (a WAV chunk); a packet is an underrun when it comes after the audio before it has
finished playing (played from the first packet on, each packet as long as its audio).
"""

from __future__ import annotations

import statistics
import time
from typing import Any

from _harness import MODELS, TINY_LLM_ARGS, Ctx, Row, at_least, at_most, in_threads, kill_daemon, p50, raise_first
from bench_tensors import _launch

TOKENS = 24                         # 8 concurrent jobs' answers
LONG = 96                           # one job's: long enough that waiting for each edge's whole input shows
CODES_PER_TOKEN = 4
# the python stages' torch on one thread, as the demo runs them: on 2 cores shared with the thinker,
# two OpenMP threads each wait at every barrier for a thread the others preempted (a 24-token job's
# first packet 6-7 s, its whole job 12-16 s; with one thread 0.4-0.6 s and about 1 s)
ONE_THREAD = {"OMP_NUM_THREADS": "1"}


def _config() -> tuple[dict[str, Any], dict[str, Any]]:
    omni = str(MODELS / "omni")
    stages: dict[str, Any] = {
        "thinker": {"engine": "vllm", "model": omni + "/thinker", "devices": [], "max_inflight": 8,
                    "hidden_prompt": True, "args": {"max_model_len": 512, "dtype": "float32", "seed": 0, "enforce_eager": True},
                    "defaults": {"max_tokens": TOKENS, "temperature": 0.0, "ignore_eos": True}},
        "talker": {"engine": "python", "sessions": "omnid.omni.stages:Talker", "model": omni, "max_inflight": 8,
                   "defaults": {"codes_per_token": CODES_PER_TOKEN}, "env": ONE_THREAD},
        "code2wav": {"engine": "python", "sessions": "omnid.omni.stages:Code2Wav", "model": omni,
                     "max_inflight": 8, "defaults": {"num_steps": 4}, "env": ONE_THREAD},
        "tts": {"engine": "vllm", "model": str(MODELS / "tts"), "devices": [], "max_inflight": 8,
                "args": {"max_model_len": 512, **TINY_LLM_ARGS},
                "defaults": {"max_tokens": 100, "temperature": 0.9, "seed": 7, "ignore_eos": True}},
        "speak_codes": {"engine": "python", "sessions": "omnid.omni.stages:Code2Wav", "model": omni,
                        "max_inflight": 8, "defaults": {"num_steps": 4, "code_offset": 1000}, "env": ONE_THREAD},
    }
    tensors = {"prompt_ids": "prompt_token_ids", "ids": "token_ids", "states": "hidden_states"}

    def omni_pipe(w1: Any, w2: Any) -> dict[str, Any]:
        return {"stages": ["thinker", "talker", "code2wav"], "outputs": {"thinker": ["text"]},
                "edges": [{"from": "thinker", "to": "talker", "window": w1, "map": tensors},
                          {"from": "talker", "to": "code2wav", "window": w2, "map": {"codes": "codes"}}]}

    def tts_pipe(w: Any) -> dict[str, Any]:
        return {"stages": ["tts", "speak_codes"],
                "edges": [{"from": "tts", "to": "speak_codes", "window": w, "map": {"codes": "token_ids"}}]}

    return stages, {"omni": omni_pipe(1, [4, 8, 16, 25]), "omni_whole": omni_pipe(-1, -1),
                    "tts": tts_pipe([4, 8, 16, 25]), "tts25": tts_pipe(25)}


def listen(packets: list[tuple[float, float]]) -> tuple[int, float]:
    """The listener's clock over (arrival, audio seconds) packets: it plays from the first packet on,
    each packet as long as its audio; a packet that comes after the audio before it has finished
    playing is late (an underrun), and the clock waits for it. (late packets, seconds waited)"""
    late, waited, clock = 0, 0.0, None
    for ts, seconds in packets:
        if clock is not None and ts > clock:
            late += 1
            waited += ts - clock
        clock = (max(clock, ts) if clock is not None else ts) + seconds
    return late, waited


def underruns(packets: list[tuple[float, float]]) -> int:
    return listen(packets)[0]


def _run(d: Any, pipeline: str, prompt: str, tokens: int = TOKENS) -> dict[str, Any]:
    params = {} if pipeline.startswith("tts") else {"thinker": {"max_tokens": tokens}}
    r = d.run(pipeline, {"prompt": prompt}, params, timeout=300).check()
    sink = "speak_codes" if pipeline.startswith("tts") else "code2wav"
    segments = r.all(type="segment", stage=sink)
    packets = [(float(e["ts"]), float(e.get("audio_s") or 0.0)) for e in segments]
    end = float(r.events[-1]["ts"])
    finished = {e["stage"]: float(e["elapsed_s"]) for e in r.all(type="stage_finished")}
    return {"ttfp": packets[0][0] - r.t0 if packets else None, "underruns": underruns(packets), "waited": listen(packets)[1], "total": end - r.t0,
            "audio_s": sum(seconds for _, seconds in packets), "stages": finished, "packets": len(packets)}


def bench_omni(ctx: Ctx) -> list[Row]:
    stages, pipelines = _config()
    d = _launch(stages, pipelines)
    try:
        rounds = ctx.n(3, 1)
        for p in ("omni", "omni_whole", "tts", "tts25"):
            _run(d, p, "warm up")                   # first jobs load the python stages' model parts
        streamed, whole, short, tts, tts25 = [], [], [], [], []
        for i in range(rounds):
            ctx.check("single jobs")
            streamed.append(_run(d, "omni", f"good morning {i}", LONG))
            whole.append(_run(d, "omni_whole", f"good morning {i}", LONG))
            tts.append(_run(d, "tts", f"hello there {i}"))
            tts25.append(_run(d, "tts25", f"hello there {i}"))
            short.append(_run(d, "omni", f"good evening {i}"))
            ctx.log(f"1st packet streamed {streamed[-1]['ttfp']:.2f} s, whole {whole[-1]['ttfp']:.2f} s, "
                    f"short {short[-1]['ttfp']:.2f} s; RTF {streamed[-1]['total'] / streamed[-1]['audio_s']:.2f}; "
                    f"tts ramp {tts[-1]['ttfp']:.2f} s, 25 {tts25[-1]['ttfp']:.2f} s")
        waves: dict[int, tuple[float, list[dict[str, Any]]]] = {}
        for c in (1, 4, 8):
            ctx.log(f"{c} concurrent omni jobs")
            t0 = time.monotonic()
            results = in_threads(c, lambda i: _run(d, "omni", f"the prompt number {i}"), timeout=max(60.0, ctx.left()))
            raise_first(results)
            waves[c] = (time.monotonic() - t0, results)         # type: ignore[assignment]
            ctx.log(f"{c} jobs: {sum(r['audio_s'] for r in results) / waves[c][0]:.2f} audio s/s, 1st packet p50 "
                    f"{p50([r['ttfp'] for r in results]):.2f} s, {sum(r['underruns'] for r in results)} of "
                    f"{sum(r['packets'] for r in results)} packets late")
        many: list[dict[str, Any]] = waves[8][1]
        ctx.log("8 concurrent tts jobs")
        tts8 = in_threads(8, lambda i: _run(d, "tts", f"speak number {i}"), timeout=max(60.0, ctx.left()))
        raise_first(tts8)
    finally:
        kill_daemon(d)
    speed = {c: sum(r["audio_s"] for r in runs) / wall for c, (wall, runs) in waves.items()}
    step1, step8 = _talker_step_times()
    s1 = p50([r["ttfp"] for r in streamed])
    w1 = p50([r["ttfp"] for r in whole])
    s8 = p50([r["ttfp"] for r in many])
    one = p50([r["ttfp"] for r in short])
    t4, t25 = p50([r["ttfp"] for r in tts]), p50([r["ttfp"] for r in tts25])
    under = sum(r["underruns"] for r in many)
    packets = sum(r["packets"] for r in many)
    rtf = statistics.median(r["total"] / r["audio_s"] for r in streamed)
    share = {s: p50([r["stages"].get(s, 0.0) / r["total"] for r in streamed]) for s in ("thinker", "talker", "code2wav")}
    return [
        Row("omni: submit -> 1st audio packet, streamed, 1 job", s1, "s", "the same pipeline with window = -1 edges",
            w1, "s", s1 / w1, "streamed / whole", at_most(0.3, "<= 0.3x"),
            f"median of {rounds}; {LONG} text tokens x {CODES_PER_TOKEN} codes, DiT 4 steps"),
        Row("omni: 1st audio packet, 8 concurrent jobs", s8, "s", "1 job", one, "s", s8 / one, "8 / 1",
            at_most(2.0, "<= 2.0x"), f"median of the 8 jobs; {TOKENS} text tokens each"),
        Row("omni: underruns, 8 concurrent streams", float(under), "packets", "packets sent", float(packets),
            "packets", under / packets if packets else None, "underruns / packets", at_most(0.0, "0"),
            "played from the first packet on, each packet as long as its audio"),
        Row("omni: real-time factor, 1 job", rtf, "x", "", None, "", rtf, "job time / audio time",
            at_most(0.5, "<= 0.5", on="value"),
            "share of the job's time: " + ", ".join(f"{s} {v:.0%}" for s, v in share.items())),
        Row("omni: audio seconds per wall second, 8 concurrent jobs", speed[8], "audio s/s", "1 job", speed[1],
            "audio s/s", speed[8] / speed[1], "8 / 1", at_least(4.0, ">= 4x"),
            f"4 jobs: {speed[4]:.2f} audio s/s ({speed[4] / speed[1]:.2f}x); each wave's audio over its wall time"),
        Row("talker: one decode step, 8 sessions batched", step8 * 1e3, "ms", "1 session", step1 * 1e3, "ms",
            step8 / step1, "8 / 1", at_most(2.0, "<= 2x"), "TalkerBatch.decode in this process, the tiny talker, "
            "median of 50 steps"),
        *[Row(f"omni: {s}'s share of a job's time, 1 job", v * 100, "%", "", None, "", v, "stage time / job time",
              None, "stage_started -> stage_finished over submit -> the job's end; the stages overlap")
          for s, v in share.items()],
        Row("tts: submit -> 1st audio packet, ramp [4, 8, 16, 25]", t4, "s", "a fixed window of 25", t25, "s",
            t4 / t25, "ramp / 25", None, f"median of {rounds}; code2wav's own ramp makes its first packet "
            "after 10 codes (6 and 4 of look-ahead)"),
        Row("tts: 1st audio packet, 8 concurrent jobs", p50([r["ttfp"] for r in tts8]), "s", "1 job", t4, "s",
            p50([r["ttfp"] for r in tts8]) / t4, "8 / 1", at_most(2.0, "<= 2x"), "median of the 8 jobs, ramp edge"),
    ]


def _talker_step_times() -> tuple[float, float]:
    """The tiny talker's batched decode step, in this process: (1 session, 8 sessions), medians."""
    import torch

    from omnid.omni import loading
    from omnid.omni.talker_batch import TalkerBatch

    talker, _ = loading.load_talker(MODELS / "omni")
    torch.set_num_threads(1)
    width = talker.thinker_to_talker_proj.in_features
    out = []
    for n in (1, 8):
        batch = TalkerBatch(talker, slots=8, capacity=512)
        for s in range(n):
            batch.lengths[batch._free.pop()] = 40 + s                  # (a prompt's worth of cache each)
        slots = list(range(n))
        times = []
        for _ in range(60):
            t0 = time.perf_counter()
            batch.decode(slots, torch.randn(n, width), [batch.lengths[s] for s in slots])
            times.append(time.perf_counter() - t0)
        out.append(statistics.median(times[10:]))
    return out[0], out[1]


FIGURES = ["omni: submit -> 1st audio packet, streamed, 1 job", "omni: 1st audio packet, 8 concurrent jobs",
           "omni: underruns, 8 concurrent streams", "omni: real-time factor, 1 job",
           "omni: audio seconds per wall second, 8 concurrent jobs", "talker: one decode step, 8 sessions batched",
           "tts: submit -> 1st audio packet, ramp [4, 8, 16, 25]", "tts: 1st audio packet, 8 concurrent jobs",
           *[f"omni: {s}'s share of a job's time, 1 job" for s in ("thinker", "talker", "code2wav")]]
