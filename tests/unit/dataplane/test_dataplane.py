"""`omnid.dataplane` in-process: real Unix sockets in a short /tmp dir, real threads, no daemon.

What the stage workers rely on: frames carry one `WorkItem` each, a sender is acknowledged only
once the receiver's `admit` returned (so it blocks exactly while the receiver's queue is full),
`abandon()` ends a blocked send, a sender survives its receiver's restart, and a malformed frame
costs only its own connection.
"""

from __future__ import annotations

import os
import pickle
import queue
import shutil
import socket
import stat
import struct
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from omnid.dataplane import wire
from omnid.dataplane.listener import Listener
from omnid.dataplane.sender import Sender
from omnid.dataplane.wire import ACK_ADMITTED, ACK_DROPPED, WorkItem

pytestmark = pytest.mark.timeout(20)


# ------------------------------------------------------------------------- helpers


def item(job: str, **inputs: Any) -> WorkItem:
    return WorkItem(job=job, pipeline="p", src="up", inputs=inputs or {"text": job})


def wait_for(cond: Callable[[], bool], timeout: float = 2.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.005)
    return cond()


class Bg(threading.Thread):
    """Runs `fn` in a thread; `outcome()` joins it and gives its result (or raises its error)."""

    def __init__(self, fn: Callable[[], Any]) -> None:
        super().__init__(daemon=True)
        self.fn = fn
        self.result: Any = None
        self.error: BaseException | None = None
        self.start()

    def run(self) -> None:
        try:
            self.result = self.fn()
        except BaseException as e:  # handed to the test's thread
            self.error = e

    def outcome(self, timeout: float = 3.0) -> Any:
        self.join(timeout)
        assert not self.is_alive(), f"still running after {timeout}s"
        if self.error is not None:
            raise self.error
        return self.result


class Stage(Listener):
    """A started Listener that can die the way its worker process would (`kill`).

    It remembers its server-side connections (by wrapping `_serve`) so that `kill` can close
    all of them and the listening socket, as the kernel does when a worker exits.
    """

    def __init__(self, path: Path, admit: Callable[[WorkItem], bool]) -> None:
        self.conns: list[socket.socket] = []
        super().__init__(path, admit)
        self.start()

    def _serve(self, conn: socket.socket) -> None:
        self.conns.append(conn)
        super()._serve(conn)

    def kill(self) -> None:
        for conn in self.conns:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        try:
            self._sock.shutdown(socket.SHUT_RDWR)    # wakes the accept thread (EINVAL)
        except OSError:
            pass
        self._thread.join(2)
        self._sock.close()


class Bounded:
    """A worker's input queue: `admit` blocks while it is full, like `Worker.admit` does."""

    def __init__(self, capacity: int = 1) -> None:
        self.q: queue.Queue[WorkItem] = queue.Queue(maxsize=capacity)
        self.closed = threading.Event()

    def admit(self, it: WorkItem) -> bool:
        while not self.closed.is_set():
            try:
                self.q.put(it, timeout=0.02)
                return True
            except queue.Full:
                continue
        return False


class Env:
    """Short socket paths, and teardown of whatever a test started."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.stages: list[Stage] = []
        self.senders: list[Sender] = []
        self.events: list[threading.Event] = []

    def path(self, stage: str) -> Path:
        return self.root / f"{stage}.sock"

    def stage(self, name: str, admit: Callable[[WorkItem], bool]) -> Stage:
        st = Stage(self.path(name), admit)
        self.stages.append(st)
        return st

    def sender(self) -> Sender:
        s = Sender(self.path)
        self.senders.append(s)
        return s

    def event(self) -> threading.Event:
        ev = threading.Event()
        self.events.append(ev)
        return ev

    def close(self) -> None:
        for ev in self.events:
            ev.set()
        for s in self.senders:
            s.close()
        for st in self.stages:
            st.kill()


@pytest.fixture
def env() -> Iterator[Env]:
    root = Path(tempfile.mkdtemp(prefix="dp", dir="/tmp"))     # AF_UNIX paths: 107 bytes at most
    e = Env(root)
    try:
        yield e
    finally:
        e.close()
        shutil.rmtree(root, ignore_errors=True)


def never() -> bool:
    return False


def closed_by_peer(s: socket.socket) -> bool:
    """The peer closed the connection without answering (an unread rest of a frame makes it a reset)."""
    try:
        return s.recv(1) == b""
    except ConnectionResetError:
        return True


def raw_connect(path: Path) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(2.0)           # a listener that hangs makes the test fail, not hang
    s.connect(str(path))
    return s


# ------------------------------------------------------------------------- codec and framing


def test_encode_decode_round_trip() -> None:
    it = WorkItem(job="j1", pipeline="t2i", src=None,
                  inputs={"prompt": "a cat", "image": b"\x89PNG" + bytes(range(256)), "n": [1, 2.5, None]},
                  params={"draw": {"seed": 3}})
    data = wire.encode(it)
    assert isinstance(data, bytes) and data[:2] == b"\x80\x05"       # pickle protocol 5
    back = wire.decode(data)
    assert back == it and back is not it
    assert back.inputs["image"] == it.inputs["image"]
    assert wire.decode(wire.encode(item("x"))).params == {}


@pytest.mark.parametrize("other", [{"job": "j", "pipeline": "p", "src": None, "inputs": {}}, ("j", "p"), None, b"x"])
def test_decode_refuses_a_frame_that_is_not_a_work_item(other: Any) -> None:
    with pytest.raises(ValueError, match=f"frame is a {type(other).__name__}, not a WorkItem"):
        wire.decode(pickle.dumps(other, protocol=5))


def test_frames_are_an_8_byte_big_endian_length_and_the_payload() -> None:
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    with a, b:
        b.settimeout(2)
        wire.send_frame(a, b"hello")
        assert b.recv(8) == b"\x00\x00\x00\x00\x00\x00\x00\x05"
        assert b.recv(5) == b"hello"
        wire.send_frame(a, b"")
        assert wire.recv_frame(b) == b""
        big = os.urandom(3 << 20)                          # several recv chunks of 1 MiB
        writer = Bg(lambda: wire.send_frame(a, big))
        assert wire.recv_frame(b) == big
        writer.outcome()


def test_recv_frame_refuses_a_length_over_max_frame_without_reading_it() -> None:
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    with a, b:
        b.settimeout(2)
        a.sendall(struct.pack(">Q", wire.MAX_FRAME + 1) + b"xyz")
        with pytest.raises(ValueError, match="too large"):
            wire.recv_frame(b)


def test_recv_frame_raises_when_the_peer_closes_mid_frame() -> None:
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    with b:
        b.settimeout(2)
        a.sendall(struct.pack(">Q", 10) + b"abc")
        a.close()
        with pytest.raises(ConnectionError):
            wire.recv_frame(b)


# ------------------------------------------------------------------------- listener and sender


def test_items_arrive_in_order_over_one_connection(env: Env) -> None:
    got: list[WorkItem] = []
    st = env.stage("b", lambda it: got.append(it) is None)
    sender = env.sender()
    sent = [item(f"j{i}", n=i) for i in range(40)]
    assert all(sender.send("b", it, never) for it in sent)
    assert got == sent
    assert len(st.conns) == 1, "the sender keeps one connection per destination"


def test_sender_is_acknowledged_only_after_admit_returned(env: Env) -> None:
    entered, release, admit_done = env.event(), env.event(), env.event()

    def admit(it: WorkItem) -> bool:
        entered.set()
        release.wait(5)
        admit_done.set()
        return True

    env.stage("b", admit)
    sender = env.sender()
    send = Bg(lambda: (sender.send("b", item("j"), never), admit_done.is_set()))
    assert entered.wait(2)
    time.sleep(0.2)
    assert send.is_alive(), "send returned while admit was still running"
    release.set()
    assert send.outcome() == (True, True)


def test_a_dropped_item_is_acknowledged_with_ack_dropped(env: Env) -> None:
    calls: list[str] = []

    def admit(it: WorkItem) -> bool:
        calls.append(it.job)
        return it.job != "dead"

    env.stage("b", admit)
    with raw_connect(env.path("b")) as s:
        wire.send_frame(s, wire.encode(item("live")))
        assert s.recv(1) == ACK_ADMITTED
        wire.send_frame(s, wire.encode(item("dead")))
        assert s.recv(1) == ACK_DROPPED
    assert ACK_ADMITTED != ACK_DROPPED
    # The sender counts a drop as delivered: it does not send the item again.
    assert env.sender().send("b", item("dead"), never) is True
    assert calls == ["live", "dead", "dead"]


def test_backpressure_blocks_the_sender_until_the_queue_has_room(env: Env) -> None:
    inbox = Bounded(capacity=1)
    env.stage("b", inbox.admit)
    sender = env.sender()
    t0 = time.monotonic()
    assert sender.send("b", item("first"), never)
    assert sender.blocked_s <= time.monotonic() - t0 + 0.01
    send = Bg(lambda: sender.send("b", item("second"), never))
    time.sleep(0.25)
    assert send.is_alive(), "send returned while the receiver's queue was full"
    assert inbox.q.get_nowait().job == "first"             # the consumer makes room
    assert send.outcome(2) is True
    assert sender.blocked_s >= 0.25
    # The queue holds "second" now: the next send blocks too, and blocked_s adds up over sends.
    send = Bg(lambda: sender.send("b", item("third"), never))
    time.sleep(0.15)
    assert send.is_alive()
    assert inbox.q.get_nowait().job == "second"
    assert send.outcome(2) is True
    assert inbox.q.get(timeout=1).job == "third"
    assert sender.blocked_s >= 0.4


def test_abandon_ends_a_blocked_send_with_false(env: Env) -> None:
    inbox = Bounded(capacity=1)
    st = env.stage("b", inbox.admit)
    sender = env.sender()
    assert sender.send("b", item("first"), never)
    before = sender.blocked_s
    job_over = threading.Event()
    send = Bg(lambda: sender.send("b", item("second"), job_over.is_set))
    time.sleep(0.25)
    assert send.is_alive()
    t = time.monotonic()
    job_over.set()
    assert send.outcome(2) is False
    assert time.monotonic() - t < 0.2 + wire.POLL_S, "abandon() is polled every POLL_S"
    assert sender.blocked_s - before >= 0.25
    # The receiver still admits the abandoned item (it drops dead jobs itself) and acks it on the
    # abandoned connection; that connection is not used again, so its late ack is never mistaken
    # for the acknowledgement of a later item.
    assert [inbox.q.get_nowait().job, inbox.q.get(timeout=1).job] == ["first", "second"]
    assert sender.send("b", item("third"), never)
    assert len(st.conns) == 2
    assert inbox.q.get(timeout=1).job == "third"


def test_abandon_already_true_sends_nothing(env: Env) -> None:
    got: list[WorkItem] = []
    st = env.stage("b", lambda it: got.append(it) is None)
    sender = env.sender()
    assert sender.send("b", item("j"), lambda: True) is False
    time.sleep(0.1)
    assert got == [] and st.conns == []


def test_on_wait_is_called_while_blocked_and_often_when_busy(env: Env) -> None:
    inbox = Bounded(capacity=1)
    env.stage("b", inbox.admit)
    sender = env.sender()
    assert sender.send("b", item("first"), never)

    def blocked_for(seconds: float, busy: bool) -> tuple[int, int]:
        waits, busy_calls = [0], [0]

        def on_wait() -> None:
            waits[0] += 1

        def is_busy() -> bool:
            busy_calls[0] += 1
            return busy

        stop = threading.Event()
        send = Bg(lambda: sender.send("b", item("blocked"), stop.is_set, on_wait=on_wait, busy=is_busy))
        time.sleep(seconds)
        stop.set()
        assert send.outcome(2) is False
        assert busy_calls[0] >= waits[0] > 0
        return waits[0], busy_calls[0]

    idle_waits, _ = blocked_for(0.35, busy=False)
    assert 2 <= idle_waits <= 0.35 / wire.POLL_S + 2, idle_waits
    # busy: a poll every BUSY_POLL_S (0.5 ms), so hundreds; idle polls would give at most 0.5/POLL_S + 2 = 7.
    # (A loose bound: the machine may be loaded.)
    busy_waits, _ = blocked_for(0.5, busy=True)
    assert busy_waits >= 15, f"busy(): a poll every {wire.BUSY_POLL_S}s, got {busy_waits} in 0.5s"


def test_send_waits_for_a_receiver_that_is_not_up_yet(env: Env) -> None:
    waits = [0]

    def on_wait() -> None:
        waits[0] += 1

    sender = env.sender()
    send = Bg(lambda: sender.send("late", item("j"), never, on_wait=on_wait))
    time.sleep(0.25)
    assert send.is_alive() and waits[0] >= 2, "on_wait() is also called while it cannot connect"
    got: list[WorkItem] = []
    env.stage("late", lambda it: got.append(it) is None)
    assert send.outcome(2) is True
    assert [it.job for it in got] == ["j"]
    assert sender.blocked_s >= 0.25


def test_a_send_started_before_the_receiver_restarted_comes_through(env: Env) -> None:
    entered, release = env.event(), env.event()
    old_got: list[str] = []

    def old_admit(it: WorkItem) -> bool:
        old_got.append(it.job)
        if it.job == "x":               # the old worker takes the item in, then dies
            entered.set()
            release.wait(5)
        return True

    old = env.stage("b", old_admit)
    sender = env.sender()
    assert sender.send("b", item("warm"), never)          # the sender holds a connection now
    send = Bg(lambda: sender.send("b", item("x"), never))
    assert entered.wait(2)
    old.kill()                                            # its process died: no ack ever comes
    time.sleep(0.25)
    assert send.is_alive(), "a send without an ack must not count as delivered"
    new_got: list[str] = []
    env.stage("b", lambda it: new_got.append(it.job) is None)   # the restarted worker, same path
    assert send.outcome(3) is True
    assert new_got == ["x"]
    assert sender.send("b", item("y"), never) and new_got == ["x", "y"]
    assert old_got == ["warm", "x"]


def test_a_cached_connection_to_a_dead_receiver_is_replaced(env: Env) -> None:
    old = env.stage("b", lambda it: True)
    sender = env.sender()
    assert sender.send("b", item("a"), never)
    old.kill()
    new_got: list[str] = []
    env.stage("b", lambda it: new_got.append(it.job) is None)
    assert sender.send("b", item("b"), never)
    assert new_got == ["b"]


@pytest.mark.parametrize("garbage", [
    pytest.param(struct.pack(">Q", 9) + b"not a pkl", id="not-a-pickle"),
    pytest.param(struct.pack(">Q", wire.MAX_FRAME + 1), id="length-over-max-frame"),
    pytest.param(struct.pack(">Q", 0xFFFFFFFFFFFFFFFF) + b"\x00" * 64, id="length-2**64-1"),
    pytest.param(b"", id="pickled-dict"),
])
def test_a_malformed_frame_drops_only_its_connection(env: Env, garbage: bytes) -> None:
    if not garbage:
        body = pickle.dumps({"job": "evil"}, protocol=5)
        garbage = struct.pack(">Q", len(body)) + body
    got: list[str] = []
    env.stage("b", lambda it: got.append(it.job) is None)
    good = env.sender()
    assert good.send("b", item("a"), never)               # a connection that stays open
    with raw_connect(env.path("b")) as bad:
        bad.sendall(garbage)
        assert closed_by_peer(bad), "the listener must close a connection that sent a malformed frame"
    assert good.send("b", item("b"), never)               # the other connection is still served
    assert env.sender().send("b", item("c"), never)       # and new ones are accepted
    assert got == ["a", "b", "c"]


def test_connections_are_served_independently(env: Env) -> None:
    release = env.event()

    def admit(it: WorkItem) -> bool:
        if it.job == "slow":
            release.wait(5)
        return True

    env.stage("b", admit)
    slow = Bg(lambda: env.sender().send("b", item("slow"), never))
    time.sleep(0.1)
    t = time.monotonic()
    assert env.sender().send("b", item("fast"), never)
    assert time.monotonic() - t < 1.0
    assert slow.is_alive()
    release.set()
    assert slow.outcome() is True


def test_sender_close_closes_its_connections(env: Env) -> None:
    st = env.stage("b", lambda it: True)
    sender = env.sender()
    assert sender.send("b", item("a"), never)
    assert len(st.conns) == 1
    sender.close()
    # The listener's reader sees the end of the stream and closes its side.
    assert wait_for(lambda: st.conns[0].fileno() == -1)


def test_listener_replaces_a_stale_socket_and_is_owner_only(env: Env) -> None:
    path = env.path("b")
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(str(path))             # a dead predecessor's socket file
    stale.close()
    got: list[str] = []
    env.stage("b", lambda it: got.append(it.job) is None)
    assert stat.S_ISSOCK(path.stat().st_mode)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert env.sender().send("b", item("j"), never) and got == ["j"]
