"""Human-readable formatting for omnictl: tables, job details, and live event progress.

Where it runs: in the omnictl CLI's main thread. The formatting functions are pure and return
strings. :class:`EventPrinter` writes to the stream it is given (stderr for ``submit --wait``,
stdout for ``watch``) and may block only on that stream. Everything reads the API's documents
defensively with ``.get``, so a daemon that adds or omits fields never breaks the display.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, TextIO

from omnictl.client import TERMINAL_STATES
from omnid.vocabulary import JobState, WorkerState

if TYPE_CHECKING:
    from omnictl.progress import StepBar

JSON = Mapping[str, Any]

NONE = "-"
_CLEAR_LINE = "\r\x1b[K"


def shorten(value: Any, width: int) -> str:
    """One line of at most ``width`` characters, with an ellipsis where it was cut."""
    text = " ".join(str(value).split())
    return text if len(text) <= width else text[: max(width - 1, 0)] + "…"


def format_duration(seconds: float | int | None) -> str:
    """``0.4s``, ``42s``, ``3m12s``, ``2h05m``, ``3d04h``; ``-`` when unknown."""
    if seconds is None or not isinstance(seconds, (int, float)):
        return NONE
    seconds = max(float(seconds), 0.0)
    if seconds < 10:
        return f"{seconds:.1f}s"
    if seconds < 60:
        return f"{seconds:.0f}s"
    minutes, secs = divmod(int(seconds), 60)
    if minutes < 60:
        return f"{minutes}m{secs:02d}s"
    hours, minutes = divmod(minutes, 60)
    if hours < 24:
        return f"{hours}h{minutes:02d}m"
    days, hours = divmod(hours, 24)
    return f"{days}d{hours:02d}h"


def format_age(timestamp: float | None, now: float) -> str:
    """How long ago ``timestamp`` was, coarsely: ``12s``, ``5m``, ``2h``, ``3d``."""
    if not isinstance(timestamp, (int, float)):
        return NONE
    seconds = max(now - timestamp, 0.0)
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{int(seconds // size)}{unit}"
    return f"{int(seconds)}s"


def format_time(timestamp: float | None) -> str:
    """A unix time as local ``YYYY-MM-DD HH:MM:SS``."""
    if not isinstance(timestamp, (int, float)):
        return NONE
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(timestamp))


def format_bytes(size: int | float | None) -> str:
    """``512B``, ``1.2KiB``, ``3.4GiB``."""
    if not isinstance(size, (int, float)):
        return NONE
    value = float(size)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{int(value)}{unit}" if unit == "B" else f"{value:.1f}{unit}"
        value /= 1024
    return NONE  # unreachable; keeps the type checker content


def _cell(value: Any) -> str:
    return NONE if value is None or value == "" else str(value)


def table(headers: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    """Left-aligned columns separated by two spaces, like ``docker ps``; no trailing blanks."""
    cells = [list(headers)] + [[_cell(value) for value in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    lines = ["  ".join(value.ljust(widths[i]) for i, value in enumerate(row)).rstrip() for row in cells]
    return "\n".join(lines)


def _job_duration(job: JSON, now: float) -> float | None:
    started = job.get("started_at")
    if not isinstance(started, (int, float)):
        return None
    finished = job.get("finished_at")
    end = finished if isinstance(finished, (int, float)) else now
    return end - started


def format_error(error: Any) -> str:
    """``draw: CUDA out of memory (stage_failed)`` from the API's error object."""
    if not isinstance(error, Mapping):
        return str(error) if error else ""
    message = str(error.get("message") or "")
    code = error.get("code")
    stage = error.get("stage")
    # The daemon's messages usually name the stage already ("stage 'draw': ..."): say it once.
    text = f"{stage}: {message}" if stage and f"'{stage}'" not in message else message
    return f"{text} ({code})" if code else text


def jobs_table(jobs: Iterable[JSON], now: float) -> str:
    """The ``omnictl status`` table of jobs."""
    rows = []
    for job in jobs:
        error = job.get("error")
        rows.append(
            [
                job.get("id"),
                job.get("pipeline"),
                job.get("state"),
                format_age(job.get("created_at"), now),
                format_duration(_job_duration(job, now)),
                shorten(format_error(error), 48) if error else None,
            ]
        )
    return table(["ID", "PIPELINE", "STATE", "AGE", "DURATION", "ERROR"], rows)


def _format_progress(progress: Any) -> str:
    if isinstance(progress, Mapping) and progress.get("total") is not None:
        return f"{progress.get('done', 0)}/{progress.get('total')}"
    if isinstance(progress, Mapping) and progress.get("done") is not None:
        return str(progress.get("done"))
    return NONE


def _format_input(value: Any) -> str:
    if isinstance(value, Mapping) and "b64" in value:
        return f"<file {value.get('filename') or '?'}>"
    if isinstance(value, Mapping) and "size" in value:          # a file input, as the job shows it
        return f"<file {value.get('filename') or '?'}, {format_bytes(value.get('size'))}>"
    if isinstance(value, list) and value and all(isinstance(v, Mapping) and "size" in v for v in value):
        return ", ".join(_format_input(v) for v in value)
    return shorten(value if isinstance(value, str) else repr(value), 60)


def _format_place(place: Any) -> str:
    """A queued job's place in one stage's queue: "3rd: 2 ahead (priority -1: 1, 0: 1), 1 running"."""
    if not isinstance(place, Mapping):
        return str(place)
    n = place.get("position")
    ahead = place.get("ahead_by_priority")
    detail = f" (priority {', '.join(f'{p}: {k}' for p, k in ahead.items())})" if isinstance(ahead, Mapping) and ahead else ""
    return f"{_ordinal(n) if isinstance(n, int) else n}: {place.get('ahead')} ahead{detail}, {place.get('running')} running"


def _ordinal(n: int) -> str:
    """1st, 2nd, 3rd, 4th, ..., 11th, 21st."""
    return f"{n}{'th' if 10 <= n % 100 <= 20 else {1: 'st', 2: 'nd', 3: 'rd'}.get(n % 10, 'th')}"


def _format_stream(stream: Mapping[str, Any]) -> str:
    """A real-time pipeline's stream: "waiting 2nd for capacity, starts in about 4.1 s (3 running)",
    or "played 3.2 s of audio, 1.4 s ahead of its listener, 0 late packets"."""
    if stream.get("position") is not None:
        return (f"waiting {_ordinal(int(stream['position']))} for capacity, starts in about "
                f"{format_duration(stream.get('estimated_start_s'))} ({stream.get('running')} running)")
    slack = float(stream.get("slack_s") or 0.0)
    where = f"{slack:.2f} s ahead of its listener" if slack >= 0 else f"{-slack:.2f} s behind its listener"
    return f"sent {float(stream.get('audio_s') or 0):.2f} s of audio, {where}, {stream.get('late_packets')} late packets"


def realtime_table(pipelines: Mapping[str, Any]) -> str:
    """The ``omnictl stages`` real-time pipelines: capacity measured, streams running and waiting."""
    rows = []
    for name, p in pipelines.items():
        if not isinstance(p, Mapping):
            continue
        cap = p.get("audio_per_s")
        rows.append([name, "yes" if p.get("warm") else "warming",
                     "-" if cap is None else f"{cap:.2f} audio s/s", "-" if p.get("streams") is None else str(p["streams"]),
                     str(p.get("running")), f"{p.get('waiting')}/{p.get('max_waiting_streams')}"
                     if p.get("overload") == "queue" else "refuse", str(p.get("refused"))])
    return table(["PIPELINE", "WARM", "CAPACITY", "ADMITS", "RUNNING", "WAITING", "REFUSED"], rows)


def job_detail(job: JSON, now: float) -> str:
    """The ``omnictl status JOB`` view: the job's fields, its stages, outputs and error."""
    fields = _job_fields(job, now)
    width = max(len(name) for name, _ in fields)
    parts = ["\n".join(f"{name.ljust(width)}  {_cell(value)}" for name, value in fields)]
    stages = job.get("stages")
    if isinstance(stages, Mapping) and stages:
        rows = []
        for name, info in stages.items():
            info = info if isinstance(info, Mapping) else {}
            rows.append([name, info.get("state"), _format_progress(info.get("progress")),
                         format_duration(info.get("elapsed_s")), info.get("segments")])
        parts.append(table(["STAGE", "STATE", "PROGRESS", "ELAPSED", "SEGMENTS"], rows))
    outputs = job.get("outputs")
    if isinstance(outputs, list) and outputs:
        rows = [[o.get("name"), o.get("file"), o.get("kind"), o.get("content_type"), format_bytes(o.get("size")),
                 o.get("stage")] for o in outputs if isinstance(o, Mapping)]
        parts.append(table(["OUTPUT", "FILE", "KIND", "TYPE", "SIZE", "STAGE"], rows))
    return "\n\n".join(parts)


def _job_fields(job: JSON, now: float) -> list[tuple[str, Any]]:
    """`omnictl status JOB`'s name/value lines: times, priority, places, inputs, params, error."""
    created = job.get("created_at")
    fields: list[tuple[str, Any]] = [
        ("id", job.get("id")),
        ("pipeline", job.get("pipeline")),
        ("state", job.get("state")),
        ("created", f"{format_time(created)} ({format_age(created, now)} ago)" if created else None),
        ("started", format_time(job.get("started_at"))),
        ("finished", format_time(job.get("finished_at"))),
        ("duration", format_duration(_job_duration(job, now))),
        ("timeout", format_duration(job.get("timeout_s"))),
    ]
    if job.get("priority"):
        fields.append(("priority", job.get("priority")))
    queue = job.get("queue")
    if isinstance(queue, Mapping):
        fields += [(f"queue {stage}", _format_place(place)) for stage, place in queue.items()]
    stream = job.get("stream")
    if isinstance(stream, Mapping):
        fields.append(("stream", _format_stream(stream)))
    inputs = job.get("inputs")
    if isinstance(inputs, Mapping):
        fields += [(f"input {key}", _format_input(value)) for key, value in inputs.items()]
    params = job.get("params")
    if isinstance(params, Mapping):
        for stage, values in params.items():
            if isinstance(values, Mapping):
                fields += [(f"param {stage}.{key}", shorten(repr(value), 60)) for key, value in values.items()]
    if job.get("error"):
        fields.append(("error", format_error(job.get("error"))))
    return fields


def final_state_line(job: JSON, now: float | None = None) -> str:
    """The line a waiting command ends with: ``3f9c2a1b7d4e succeeded in 4.2s`` or the error."""
    now = time.time() if now is None else now
    state = job.get("state") or "unknown"
    duration = _job_duration(job, now)
    line = f"{job.get('id')} {state}"
    if duration is not None:
        line += f" {'in' if state == JobState.SUCCEEDED else 'after'} {format_duration(duration)}"
    if job.get("error"):
        line += f": {format_error(job.get('error'))}"
    return line


def stages_table(stages: Iterable[JSON]) -> str:
    """The ``omnictl stages`` table: one row per stage, and one per replica under a stage that has
    several (`draw#1`); a stage's row sums its replicas."""
    rows = []
    for stage in stages:
        replicas = stage.get("replicas")
        many = isinstance(replicas, list) and len(replicas) > 1
        rows.append(_stage_row(stage, str(stage.get("name")), pid=None if many else stage.get("pid")))
        if many:
            for r in replicas or []:
                if isinstance(r, dict):
                    label = f"  {r.get('label') or r.get('name')}" + (" (retiring)" if r.get("retiring") else "")
                    rows.append(_stage_row(r, label, pid=r.get("pid")))
    headers = ["NAME", "ENGINE", "STATE", "PID", "NODE", "DEVICES", "QUEUE", "DONE", "RESTARTS", "RSS", "CPU%", "UPTIME", "LAST ERROR"]
    return table(headers, rows)


def _limits(key: JSON) -> str:
    parts = []
    if key.get("max_jobs") is not None:
        parts.append(f"{key['max_jobs']} jobs")
    if key.get("rps") is not None:
        parts.append(f"{key['rps']:g}/s")
    if key.get("admin"):
        parts.append("admin")
    return ", ".join(parts) or "-"


def keys_table(keys: Iterable[JSON], now: float) -> str:
    """The ``omnictl key list`` table."""
    rows = [[k.get("name"), k.get("uid"), f"{k.get('hint') or ''}...", _limits(k), format_age(k.get("created"), now)]
            for k in keys]
    return table(["NAME", "UID", "KEY", "LIMITS", "CREATED"], rows) if rows else "no API keys"


def key_added(key: JSON) -> str:
    """What ``omnictl key add`` says before the key itself (its last line)."""
    return (f"key {key.get('name')} for uid {key.get('uid')} (limits: {_limits(key)}); it is shown this once, "
            "below: keep it now")


def _node(stage: JSON) -> str | None:
    """Where a stage (or replica) runs: `local`, or `ray:<node ip>` for a Ray-placed worker."""
    placement = stage.get("placement")
    if placement is None:
        return None
    if placement == "ray":
        ray = stage.get("ray")
        node_id = ray.get("node_id") if isinstance(ray, dict) else None
        if not stage.get("node"):
            return "ray"
        return f"ray:{stage.get('node')}" + (f"/{str(node_id)[:8]}" if node_id else "")
    return str(placement)


def _stage_row(stage: JSON, name: str, pid: Any) -> list[Any]:
    devices = stage.get("devices")
    if isinstance(devices, list):
        device_text = ",".join(str(d) for d in devices) if devices else "cpu"
    else:
        device_text = None
    depth, capacity = stage.get("queue_depth"), stage.get("queue_capacity")
    queue = None if depth is None else (f"{depth}/{capacity}" if capacity is not None else str(depth))
    cpu = stage.get("cpu_percent")
    state = stage.get("state")
    if state == WorkerState.SLEEPING and stage.get("idle_unload_s"):
        state = f"sleeping (idle_unload_s {stage.get('idle_unload_s'):g})"
    engine = stage.get("engine")
    info = stage.get("info")
    if isinstance(info, Mapping) and info.get("batching"):
        engine = f"{engine}/{info['batching']}"     # a batching diffusers stage: per step or per call
    return [
        name,
        engine,
        state,
        pid,
        _node(stage),
        device_text,
        queue,
        stage.get("jobs_done"),
        stage.get("restarts"),
        format_bytes(stage.get("rss_bytes")),
        f"{cpu:.1f}" if isinstance(cpu, (int, float)) else None,
        format_duration(stage.get("uptime_s")),
        shorten(stage.get("last_error"), 40) if stage.get("last_error") else None,
    ]


def _format_edge(edge: JSON) -> str:
    window = edge.get("window")
    if window == -1:
        window_text = "window -1 (whole output)"
    elif isinstance(window, int):
        window_text = f"window {window} (every {window} segment{'s' if window != 1 else ''})"
    else:
        window_text = f"window {_cell(window)}"
    text = f"{edge.get('from')} -> {edge.get('to')}  {window_text}"
    mapping = edge.get("map")
    if isinstance(mapping, Mapping) and mapping:
        text += "  map " + ", ".join(f"{key}={value}" for key, value in mapping.items())
    if edge.get("transform"):
        text += f"  transform {edge.get('transform')}"
    return text


def pipelines_text(pipelines: Iterable[JSON]) -> str:
    """The ``omnictl pipelines`` listing: each pipeline, its stages and its edges."""
    blocks = []
    for pipeline in pipelines:
        header = str(pipeline.get("name"))
        if pipeline.get("timeout_s") is not None:
            header += f"  (timeout {format_duration(pipeline.get('timeout_s'))})"
        lines = [header, "  stages  " + ", ".join(str(s) for s in pipeline.get("stages") or [])]
        edges = [e for e in pipeline.get("edges") or [] if isinstance(e, Mapping)]
        for i, edge in enumerate(edges):
            lines.append(("  edges   " if i == 0 else "          ") + _format_edge(edge))
        adapters = pipeline.get("adapters")
        for stage, lora in (adapters.items() if isinstance(adapters, Mapping) else ()):
            if isinstance(lora, Mapping):       # a stage's LoRA adapters, and the base model they adapt
                names = ", ".join(str(a.get("name")) for a in lora.get("adapters") or [] if isinstance(a, Mapping))
                lines.append(f"  lora    {stage}: {names or '(none yet)'}  (base {lora.get('base')})")
        blocks.append("\n".join(lines))
    return "\n\n".join(blocks)


def _format_rule(doc: Mapping[str, Any]) -> str:
    """``integer 1..1000``, ``integer 8..4096, multiple of 8``, ``number > 0``, ``string or list of strings``."""
    kind = doc.get("type")
    if kind is None and isinstance(doc.get("anyOf"), list):
        kinds = [_format_rule(alt) for alt in doc["anyOf"] if isinstance(alt, Mapping)]
        return " or ".join(kinds) if kinds else "any"
    if isinstance(kind, list):
        return " or ".join(map(str, kind))
    if kind == "array":
        items = doc.get("items")
        return f"list of {_format_rule(items)}s" if isinstance(items, Mapping) else "list"
    text = str(kind) if kind else "any"
    low, high = doc.get("minimum"), doc.get("maximum")
    if "exclusiveMinimum" in doc:
        text += f" > {doc['exclusiveMinimum']}" + (f", <= {high}" if high is not None else "")
    elif low is not None and high is not None:
        text += f" {low}..{high}"
    elif low is not None:
        text += f" >= {low}"
    elif high is not None:
        text += f" <= {high}"
    if doc.get("multipleOf") is not None:
        text += f", multiple of {doc['multipleOf']}"
    if isinstance(doc.get("enum"), list):
        text += " (" + "|".join(map(str, doc["enum"])) + ")"
    return text


def pipeline_detail(doc: JSON) -> str:
    """The ``omnictl pipelines NAME`` view: inputs, each stage's parameters, edges and outputs."""
    parts = [pipelines_text([doc])]
    lines = ["INPUTS"]
    for stage, info in (doc.get("inputs") or {}).items():
        info = info if isinstance(info, Mapping) else {}
        raw = info.get("inputs")
        inputs: Mapping[str, Any] = raw if isinstance(raw, Mapping) else {}
        for name, spec in inputs.items():
            spec = spec if isinstance(spec, Mapping) else {}
            need = "required" if spec.get("required") else "optional"
            lines.append(f"  {name}  {spec.get('type') or 'any'}, {need}  (stage {stage}, {info.get('engine')})")
            if spec.get("type") == "file" and spec.get("description"):      # a media input: what it takes
                lines.append(f"      {spec['description']}")
        if not info.get("known", True):
            lines.append(f"  stage {stage} ({info.get('engine')}): {info.get('note') or 'unknown'}")
    parts.append("\n".join(lines))
    for stage, info in (doc.get("params") or {}).items():
        info = info if isinstance(info, Mapping) else {}
        raw = info.get("params")
        params: Mapping[str, Any] = raw if isinstance(raw, Mapping) else {}
        header = f"PARAMS {stage} ({info.get('engine')})"
        if info.get("accepts") != "listed":
            header += f": {info.get('accepts')}"
        rows = []
        for name, spec in params.items():
            spec = spec if isinstance(spec, Mapping) else {}
            rule = _format_rule(spec) if info.get("accepts") == "listed" else "any"
            rows.append(["  " + name, rule, repr(spec["default"]) if "default" in spec else None])
        parts.append(header + ("\n" + table(["  NAME", "TYPE", "DEFAULT"], rows) if rows else ""))
    lines = ["OUTPUTS"]
    for stage, info in (doc.get("outputs") or {}).items():
        info = info if isinstance(info, Mapping) else {}
        for out in info.get("outputs") or []:
            if isinstance(out, Mapping):
                lines.append(f"  {out.get('name')}  {out.get('file') or '-'}  {out.get('content_type')}  (stage {stage})")
        if not info.get("known", True):
            lines.append(f"  stage {stage} ({info.get('engine')}): {info.get('note') or 'unknown'}")
    parts.append("\n".join(lines))
    return "\n\n".join(parts)


def _stage_states(stages: Any) -> list[tuple[str, str]]:
    """``[(name, state)]`` from a ready document's ``stages``, a dict or a list, whatever it holds."""
    pairs: list[tuple[str, str]] = []
    if isinstance(stages, Mapping):
        for name, value in stages.items():
            state = value.get("state") if isinstance(value, Mapping) else value
            pairs.append((str(name), _cell(state)))
    elif isinstance(stages, list):
        for value in stages:
            if isinstance(value, Mapping):
                pairs.append((str(value.get("name")), _cell(value.get("state"))))
    return pairs


def ready_text(ok: bool, body: JSON) -> str:
    """``ready`` or ``not ready: draw, expand``, followed by each stage's state when known."""
    if ok:
        lines = ["ready"]
    else:
        not_ready = body.get("not_ready")
        raw_reasons, raw_disk = body.get("reasons"), body.get("disk")
        reasons = raw_reasons if isinstance(raw_reasons, list) else []
        what = [str(n) for n in not_ready] if isinstance(not_ready, list) else []
        disk = raw_disk if isinstance(raw_disk, Mapping) else {}
        if "disk_full" in reasons:
            what.append(f"disk full ({disk.get('reason') or 'under daemon.min_free_mb'}); new jobs are refused")
        if body.get("draining"):
            what.append("draining")
        lines = [f"not ready: {', '.join(what) or 'unknown'}"]
    pairs = _stage_states(body.get("stages"))
    width = max((len(name) for name, _ in pairs), default=0)
    down = body.get("replicas_down") if isinstance(body.get("replicas_down"), dict) else {}
    lazy = set(body.get("lazy") or ()) if isinstance(body.get("lazy"), list) else set()
    for name, state in pairs:
        lines.append(f"  {name.ljust(width)}  {state}" + ("  (lazy: loads on its first job)" if name in lazy else ""))
        replicas = down.get(name) if isinstance(down, dict) else None
        if isinstance(replicas, dict) and replicas:
            lines.append(f"  {''.ljust(width)}  down: " + ", ".join(f"{r} ({s})" for r, s in replicas.items()))
    return "\n".join(lines)


def first_output_line(seconds: float, running: Sequence[str] = (), what: str = "output") -> str:
    """``first output after 0.42s (expand still running)``: when a last stage's first output (or
    ``what``: "audio") came, and which other stages had not finished then."""
    seconds = max(float(seconds), 0.0)
    text = f"first {what} after {seconds:.2f}s" if seconds < 10 else f"first {what} after {format_duration(seconds)}"
    return text + (f" ({', '.join(running)} still running)" if running else "")


class EventPrinter:
    """Renders a job's events as they arrive: stage start/finish lines, progress, streamed text.

    On a terminal (``live=True``) a stage's progress rewrites one line in place; otherwise every
    update is its own plain line, fit for logs. Text segments are written token by token on a
    ``stage: `` line that stays open until the segment marked ``is_last``. Terminal ``state``
    events are not printed: the caller ends with :func:`final_state_line` from the final job.
    """

    def __init__(self, stream: TextIO, live: bool, sinks: Iterable[str] = (), created_at: float | None = None) -> None:
        self.stream = stream
        self.live = live
        # The pipeline's last stages (no outgoing edge): their first segment (or output) gets one
        # "first output after" line, timed from ``created_at`` (the job's, by the daemon's clock).
        self.sinks = frozenset(sinks)
        self.created_at = created_at
        self._t0 = time.time()
        self._first_output_said = not self.sinks
        self._first_audio_said = False
        self._running: dict[str, None] = {}   # stages started and not finished, in start order
        # What the unfinished last line holds: ("text" | "progress", stage), or None.
        self._open: tuple[str, str] | None = None
        # Stages that stream text: their tokens already show progress, step lines would only interleave.
        self._texting: set[str] = set()
        # live: each stage's step bar (rich), made on its first progress event.
        self._bars: dict[str, StepBar] = {}

    def _write(self, text: str) -> None:
        self.stream.write(text)
        self.stream.flush()

    def _since(self, event: JSON) -> float:
        """The event's time since the job was created (by the daemon's clock when it says)."""
        ts = event.get("ts")
        if isinstance(ts, (int, float)) and isinstance(self.created_at, (int, float)):
            return float(ts - self.created_at)
        return time.time() - self._t0

    def close_line(self) -> None:
        """End an unfinished text or progress line, so the next output starts on its own line."""
        if self._open is not None:
            self._write("\n")
            self._open = None

    def _line(self, text: str) -> None:
        self.close_line()
        self._write(text + "\n")

    def feed(self, event: JSON) -> None:
        """Render one event."""
        kind = event.get("type")
        stage = str(event.get("stage") or "")
        if kind == "stage_started":
            self._running[stage] = None
        elif kind in ("stage_finished", "error"):
            self._running.pop(stage, None)
        elif kind in ("segment", "output") and not self._first_output_said and stage in self.sinks:
            self._first_output_said = True
            self._line(first_output_line(self._since(event), [s for s in self._running if s != stage]))
        if kind == "segment" and event.get("audio_s") and not self._first_audio_said:
            self._first_audio_said = True          # a last stage's first audio packet (its seconds counted)
            self._line(first_output_line(self._since(event), [s for s in self._running if s != stage], "audio"))
        if kind == "state":
            if event.get("state") not in TERMINAL_STATES:
                self._line(f"job {event.get('job')} {event.get('state')}")
        elif kind == "stage_started":
            self._line(f"{stage}: started")
        elif kind == "stage_finished":
            elapsed = event.get("elapsed_s")
            self._line(f"{stage}: finished" + (f" in {format_duration(elapsed)}" if elapsed is not None else ""))
        elif kind == "progress":
            self._progress(stage, event)
        elif kind == "segment":
            self._segment(stage, event)
        elif kind == "output":
            detail = ", ".join(str(v) for v in (event.get("kind"), event.get("content_type")) if v)
            self._line(f"{stage}: output {event.get('name')}" + (f" ({detail})" if detail else ""))
        elif kind == "error":
            code = event.get("code")
            self._line(f"{stage}: error: {event.get('message')}" + (f" ({code})" if code else ""))
        elif kind == "stage_waking":
            self._line(f"{stage}: asleep; waking it")
        elif kind == "stage_awake":
            woke = event.get("wake_s")
            self._line(f"{stage}: awake" + (f" (loaded in {format_duration(woke)})" if woke is not None else ""))

    def _progress(self, stage: str, event: JSON) -> None:
        if stage in self._texting:
            return
        total = event.get("total")
        text = f"{stage}: step {event.get('done')}" + (f"/{total}" if total is not None else "")
        if not self.live:
            self._line(text)
            return
        # A terminal: a bar with the rate and the time left, rewritten in place.
        text = self._bar(stage).line(int(event.get("done") or 0), total if isinstance(total, int) else None)
        if self._open == ("progress", stage):
            self._write(_CLEAR_LINE + text)
        else:
            self.close_line()
            self._write(text)
            self._open = ("progress", stage)

    def _bar(self, stage: str) -> StepBar:
        bar = self._bars.get(stage)
        if bar is None:
            from omnictl.progress import StepBar  # rich is loaded only when a bar is drawn

            try:
                columns = os.get_terminal_size(self.stream.fileno()).columns
            except (OSError, ValueError, AttributeError):
                columns = 0
            columns = columns or 80                  # (a pty nobody sized says 0)
            bar = self._bars[stage] = StepBar(stage, columns - 1)   # one short: never wraps
        return bar

    def _segment(self, stage: str, event: JSON) -> None:
        text = event.get("text")
        if not isinstance(text, str):
            return  # image previews and audio chunks have nothing to show in a terminal
        self._texting.add(stage)
        if self._open != ("text", stage):
            self.close_line()
            self._write(f"{stage}: ")
            self._open = ("text", stage)
        if text:
            self._write(text)
        if event.get("is_last"):
            self.close_line()


def adapters_table(doc: JSON) -> str:
    """``omnictl adapter list STAGE``: the stage's adapters, their folders, and its base model."""
    lora = doc.get("lora") if isinstance(doc, Mapping) else None
    if not isinstance(lora, Mapping):
        return f"stage {doc.get('stage')} has no lora table (no adapters)"
    rows = [[str(a.get("name")), str(a.get("path"))] for a in lora.get("adapters") or [] if isinstance(a, Mapping)]
    head = (f"stage {doc.get('stage')}: base {lora.get('base')}, max_loras {lora.get('max_loras')}, "
            f"max_lora_rank {lora.get('max_lora_rank')}")
    return head + ("\n" + table(["NAME", "PATH"], rows) if rows else "\n(no adapters)")
