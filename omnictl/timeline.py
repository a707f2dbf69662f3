"""`omnictl trace JOB`: a job's timeline from omnid's own events, one bar per stage and edge.

Pure functions (no I/O): `timeline` builds the rows from the job's document, its events
(`GET /v1/jobs/{id}/events`) and its pipeline's edges (`GET /v1/pipelines/{name}`); `waterfall`
draws them for a terminal. Needs no trace collector: it reads what the daemon keeps of every job.

Rows, in the pipeline's order:
- the job: from its submission to its end; `wait` (queued) until its first stage started it;
- each stage: `wait` from the moment its input could be there (the job's submission for a first
  stage, else its upstreams' hand-off) to its start, then its run to its end, with the times of its
  first and last segments;
- each edge `src -> dst`: from the upstream's output being there (its first segment on a streaming
  edge, its end otherwise) to the downstream starting on it (the hand-off, and the queue behind it).
Times are seconds from the job's submission.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

JSON = Mapping[str, Any]

WAIT, RUN, MARK, EMPTY = "░", "█", "▌", " "


@dataclass
class _Marks:
    """What a job's events say of its stages: when each started and finished, its segments' times."""

    t0: float
    last_ts: float
    trace_id: str | None = None
    started: dict[str, float] = field(default_factory=dict)
    finished: dict[str, float] = field(default_factory=dict)
    first_seg: dict[str, float] = field(default_factory=dict)
    last_seg: dict[str, float] = field(default_factory=dict)
    segments: dict[str, int] = field(default_factory=dict)


def _marks(events: Iterable[JSON], t0: float) -> _Marks:
    m = _Marks(t0, t0)
    for ev in events:
        ts = float(ev.get("ts") or t0)
        m.last_ts = max(m.last_ts, ts)
        kind, stage = ev.get("type"), ev.get("stage")
        if kind == "state" and ev.get("trace_id"):
            m.trace_id = ev["trace_id"]
        elif kind == "stage_started" and stage:
            m.started.setdefault(stage, ts)
        elif kind == "stage_finished" and stage:
            m.finished[stage] = ts
        elif kind == "segment" and stage:
            m.first_seg.setdefault(stage, ts)
            m.last_seg[stage] = ts
            m.segments[stage] = m.segments.get(stage, 0) + 1
    return m


def timeline(job: JSON, events: Iterable[JSON], edges: Sequence[JSON] = ()) -> dict[str, Any]:
    """The job's rows (see the module's doc), as a JSON document."""
    t0 = float(job.get("created_at") or 0.0)
    end_job = job.get("finished_at")
    m = _marks(events, t0)
    started, finished, first_seg, last_seg, segments = m.started, m.finished, m.first_seg, m.last_seg, m.segments
    end = float(end_job) if end_job else m.last_ts
    stage_docs: Mapping[str, Any] = job.get("stages") or {}

    def rel(ts: float | None) -> float | None:
        return None if ts is None else round(ts - t0, 4)

    def stage_end(name: str) -> float | None:
        run = stage_docs.get(name) or {}
        return finished.get(name) or run.get("finished_at") or (end if name in started else None)

    def ready(edge: JSON) -> float | None:
        """When an edge's upstream output was there."""
        src = str(edge.get("from"))
        window = edge.get("window")
        streamed = bool(window) and window != 0 and src in first_seg
        return first_seg[src] if streamed else (finished.get(src) or (stage_docs.get(src) or {}).get("finished_at"))

    rows: list[dict[str, Any]] = []
    job_start = float(job.get("started_at") or 0.0) or None
    rows.append({"kind": "job", "name": "job", "state": job.get("state"), "wait_from": 0.0,
                 "start": rel(job_start), "end": rel(end)})
    incoming: dict[str, list[JSON]] = {}
    for e in edges:
        incoming.setdefault(str(e.get("to")), []).append(e)
    for name in stage_docs:
        inputs = [r for e in incoming.get(name, []) if (r := ready(e)) is not None]
        wait_from = min(inputs) if inputs else (t0 if not incoming.get(name) else None)
        rows.append({"kind": "stage", "name": name, "state": (stage_docs.get(name) or {}).get("state"),
                     "wait_from": rel(wait_from), "start": rel(started.get(name)), "end": rel(stage_end(name)),
                     "first_segment": rel(first_seg.get(name)), "last_segment": rel(last_seg.get(name)),
                     "segments": segments.get(name, 0)})
        for e in incoming.get(name, []):
            src_ready = ready(e)
            rows.append({"kind": "edge", "name": f"{e.get('from')} -> {name}", "src": e.get("from"), "dst": name,
                         "window": e.get("window"), "start": rel(src_ready),
                         "end": rel(started.get(name)) if src_ready is not None else None})
    return {"job": job.get("id"), "pipeline": job.get("pipeline"), "state": job.get("state"),
            "trace_id": m.trace_id, "created_at": t0, "duration_s": round(end - t0, 4), "rows": rows}


def _secs(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value * 1000:.0f}ms" if value < 1 else f"{value:.2f}s"


def _extra(r: Mapping[str, Any]) -> str:
    if r["kind"] == "stage" and r.get("first_segment") is not None:
        return f"  first {_secs(r['first_segment'])}, last {_secs(r.get('last_segment'))}, {r['segments']} seg"
    if r["kind"] in ("job", "stage") and r.get("start") is not None and r.get("wait_from") is not None:
        return f"  waited {_secs(max(0.0, r['start'] - r['wait_from']))}"
    return ""


def waterfall(doc: Mapping[str, Any], width: int = 100) -> str:
    """The timeline drawn as text in `width` columns (at least 20 for the bars): a label, a bar (`░`
    waiting, `█` running, `▌` a stage's first segment), the start, the length, and a stage's segments."""
    rows: list[dict[str, Any]] = list(doc.get("rows") or [])
    total = max(float(doc.get("duration_s") or 0.0), 1e-6)
    label_w = max([len(r["name"]) + (2 if r["kind"] != "job" else 0) for r in rows] + [8])
    extra_w = max([len(_extra(r)) for r in rows] + [0])
    bar_w = max(20, width - label_w - 2 - 18 - extra_w)
    head = f"job {doc.get('job')}  {doc.get('pipeline')}  {doc.get('state')}  {_secs(total)}"
    if doc.get("trace_id"):
        head += f"  trace {doc['trace_id']}"
    lines = [head, f"{'':{label_w}}  0{'':{bar_w - 1 - len(_secs(total))}}{_secs(total)}"]

    def col(t: float | None) -> int | None:
        return None if t is None else min(bar_w - 1, max(0, int(round(t / total * (bar_w - 1)))))

    for r in rows:
        cells = [EMPTY] * bar_w
        start, end = col(r.get("start")), col(r.get("end"))
        wait = col(r.get("wait_from"))
        if r["kind"] == "edge":
            if start is not None and end is not None:
                for i in range(start, max(end, start) + 1):
                    cells[i] = WAIT
        else:
            if wait is not None:
                for i in range(wait, (start if start is not None else (end if end is not None else wait)) + 1):
                    cells[i] = WAIT
            if start is not None:
                for i in range(start, max(end if end is not None else start, start) + 1):
                    cells[i] = RUN
            first = col(r.get("first_segment"))
            if first is not None and r["kind"] == "stage":
                cells[first] = MARK
        label = r["name"] if r["kind"] == "job" else "  " + r["name"]
        begin = r.get("start") if r["kind"] != "stage" or r.get("start") is not None else r.get("wait_from")
        length = (r["end"] - r["start"]) if r.get("start") is not None and r.get("end") is not None else None
        lines.append(f"{label:{label_w}}  {''.join(cells)}  {_secs(begin):>7} +{_secs(length):<7}{_extra(r)}")
    lines.append(f"{'':{label_w}}  {WAIT} waiting  {RUN} running  {MARK} first segment")
    return "\n".join(line.rstrip() for line in lines)
