"""A caller that hung up while part of its answer still waits in the server's send buffer is gone
(omnid/supervisor/http/http_common.py: `gone`, `next_event`).

When the peer closes its side, asyncio closes the transport at once (`is_closing()`), but keeps it
on the protocol (so `request.transport` is not None) until the bytes it holds are written, which
never happens for a caller that no longer reads. `gone` must read the transport's closing flag,
not only its absence; otherwise a handler waiting on a quiet job's events (`next_event`) waits
for ever for a caller that left.

In-process: a real aiohttp server on a loopback TCP socket and a raw client socket (a small
receive buffer, so that the answer's first bytes fill the socket buffers and the rest waits in
the transport).
"""

from __future__ import annotations

import asyncio
import socket
from typing import Any

import pytest
from aiohttp import web

from omnid.supervisor.http.http_common import DISCONNECT_POLL_S, gone, next_event

pytestmark = pytest.mark.timeout(30)

PENDING = 32 * 1024
WAIT_S = 1.2              # about 5 of HangupWatch's sweeps


async def scenario(half_close: bool) -> tuple[str, bool, bool]:
    """Serve one streamed answer, let the client stop reading (and half-close when asked), and wait
    on an empty event queue: what the wait ended with ("gone", or "waiting" after WAIT_S), and whether
    the transport was closing and still there when the wait began."""
    filled = asyncio.Event()
    outcome: asyncio.Future[tuple[str, bool, bool]] = asyncio.get_running_loop().create_future()

    async def handler(request: web.Request) -> web.StreamResponse:
        transport = request.transport
        assert transport is not None
        sock = transport.get_extra_info("socket")
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        # Until the kernel's buffers are full and 32 KiB more wait in the transport (under its
        # high-water mark: the writes do not block).
        while transport.get_write_buffer_size() < PENDING:
            await resp.write(b"data: " + b"x" * 8192 + b"\n\n")
            await asyncio.sleep(0.01)
        filled.set()
        queue: asyncio.Queue[Any] = asyncio.Queue()        # a quiet job: no event comes
        try:
            await asyncio.sleep(0.3)                         # (the client's FIN, if any, has come)
            t = request.transport
            state = (t is not None and t.is_closing(), t is not None)
            try:
                await asyncio.wait_for(next_event(request, queue), timeout=WAIT_S)
                outcome.set_result(("event", *state))
            except ConnectionResetError:
                outcome.set_result(("gone", *state))
            except asyncio.TimeoutError:
                outcome.set_result(("waiting", *state))
        except BaseException as e:       # (the handler cancelled: say so rather than hang the test)
            if not outcome.done():
                outcome.set_exception(e)
            raise
        return resp

    app = web.Application()
    app.router.add_get("/events", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    client = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    client.setblocking(False)
    loop = asyncio.get_running_loop()
    try:
        await loop.sock_connect(client, ("127.0.0.1", port))
        await loop.sock_sendall(client, b"GET /events HTTP/1.1\r\nHost: omnid\r\n\r\n")
        await asyncio.wait_for(filled.wait(), 10)
        if half_close:
            client.shutdown(socket.SHUT_WR)                # hung up: it says no more, and reads nothing
        return await asyncio.wait_for(outcome, 10)
    finally:
        client.close()
        await runner.cleanup()


def test_a_caller_that_hung_up_with_bytes_pending_is_gone() -> None:
    what, closing, present = asyncio.run(scenario(half_close=True))
    assert closing and present, "the transport was not in the closing-with-bytes-pending state"
    assert what == "gone", f"next_event still {what} {WAIT_S / DISCONNECT_POLL_S:.0f} sweeps after the caller hung up"


def test_a_caller_that_only_reads_slowly_is_not_gone() -> None:
    what, closing, present = asyncio.run(scenario(half_close=False))
    assert present and not closing
    assert what == "waiting"


def test_gone_reads_the_closing_flag() -> None:
    class Transport:
        def __init__(self, closing: bool) -> None:
            self.closing = closing

        def is_closing(self) -> bool:
            return self.closing

    class Request:
        def __init__(self, transport: Transport | None) -> None:
            self.transport = transport

    assert gone(Request(None))                                     # type: ignore[arg-type]
    assert gone(Request(Transport(True)))                          # type: ignore[arg-type]
    assert not gone(Request(Transport(False)))                     # type: ignore[arg-type]
