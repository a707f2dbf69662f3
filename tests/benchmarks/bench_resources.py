"""Many clients: what thousands of held event streams cost the daemon's other callers.

On the shared "control" daemon: a quiet job (the `ab` pipeline's sleeper, which emits no progress)
and N event streams of it held open on raw Unix sockets (each answered 200 and its first event
read). The figure is `GET /v1/health`'s p50 while they are held, against its p50 with none held,
measured in the same run: the waiting streams must cost the loop (almost) nothing (one
HangupWatch sweep every 0.25 s, no timer per stream).
"""

from __future__ import annotations

import socket
import time

from _harness import Ctx, Row, at_most, fmt, health_p50
from omnidtest import open_event_stream


def bench_held_streams(ctx: Ctx) -> list[Row]:
    d = ctx.daemon("control")
    n_streams, n_probe = ctx.n(2000, 500), ctx.n(300, 100)
    job = d.submit("ab", {"text": "x"}, {"sa": {"seconds": 600}})
    held: list[socket.socket] = []
    try:
        before = health_p50(d, n_probe)
        t0 = time.monotonic()
        for i in range(n_streams):
            if i % 200 == 0:
                ctx.check(f"stream {i}")
            held.append(open_event_stream(str(d.socket), job))
        opened_s = time.monotonic() - t0
        during = health_p50(d, n_probe)
    finally:
        for s in held:
            s.close()
        d.client.cancel(job)
    after_close = health_p50(d, n_probe)
    return [Row(f"GET /v1/health p50 with {n_streams} event streams held", during, "s",
                "same, none held (before and after)", (before + after_close) / 2, "s",
                during / ((before + after_close) / 2), "held / none", at_most(2.0, "<= 2x"),
                f"{n_streams} streams opened in {fmt(opened_s)} s; none held: before {fmt(before, 's')}, "
                f"after {fmt(after_close, 's')}")]
