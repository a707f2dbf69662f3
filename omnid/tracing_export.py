"""A traced process's exporter process (`python -m omnid.tracing_export SPEC`): the spans of the
process that started it (`omnid.tracing.Tracing`) come on stdin, in batches (a 4-byte length, then a
pickled list of `SpanTuple`s); each is made an SDK span (`SpanMaker`) and handed to
opentelemetry-sdk's `BatchSpanProcessor` with the OTLP/HTTP exporter, under that process's resource.

SPEC (JSON): {"url": the receiver's /v1/traces, "resource": the process's resource attributes,
"log": [level, format, process]}. It ends when its stdin closes (the process stopped its tracing,
or ended, even by SIGKILL), once what it has is exported (bounded by the export timeout). A SIGINT
meant for the process group (a Ctrl-C to a daemon in the foreground) does not end it before that.
"""

from __future__ import annotations

import json
import pickle
import signal
import struct
import sys
from typing import Any, BinaryIO, cast


def _read(stream: BinaryIO, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = stream.read(n - len(data))
        if not chunk:
            return data
        data += chunk
    return data


def main(argv: list[str]) -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    spec = json.loads(argv[1])
    from omnid import logs
    from omnid.prctl import set_process_name
    level, fmt, process = spec["log"]
    logs.configure(level, fmt, process=process)
    # `ps` (15 characters of it): omnid:spans (the supervisor's), omnid:spans:STAGE (a worker's)
    owner = process.removesuffix(":spans").removeprefix("stage:")
    set_process_name("omnid:spans" if owner in ("supervisor", "omnid") else f"omnid:spans:{owner}")

    import logging
    import os

    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    from omnid.tracing import EXPORT_TIMEOUT_S, SCHEDULE_DELAY_MS, QuietExporter, SpanMaker

    # The exporter's own log lines (one per failed batch, with a traceback) give way to ours: once.
    logging.getLogger("opentelemetry.exporter.otlp").setLevel(logging.CRITICAL)
    url = spec["url"]
    maker = SpanMaker(spec["resource"])
    exporter = QuietExporter(OTLPSpanExporter(endpoint=url, timeout=EXPORT_TIMEOUT_S), url)
    delay = None if os.environ.get("OTEL_BSP_SCHEDULE_DELAY") else SCHEDULE_DELAY_MS
    processor = BatchSpanProcessor(cast(Any, exporter), schedule_delay_millis=delay)
    stdin = sys.stdin.buffer
    try:
        while True:
            header = _read(stdin, 4)
            if len(header) < 4:
                break
            size = struct.unpack("!I", header)[0]
            data = _read(stdin, size)
            if len(data) < size:            # (its process ended while it wrote)
                break
            for span in pickle.loads(data):
                processor.on_end(maker.make(span))
    finally:
        processor.shutdown()        # what is queued goes (bounded by the export timeout)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
