"""Shared memory between stages, in-process: the pool's allocator, and large values through a real
`Listener`/`Sender` pair over a Unix socket (the receiver's pool reaches the sender by SCM_RIGHTS)."""

from __future__ import annotations

import gc
import os
import queue
import shutil
import socket
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from omnid.dataplane import shm, wire
from omnid.dataplane.listener import Listener
from omnid.dataplane.sender import Sender
from omnid.dataplane.wire import WorkItem

pytestmark = pytest.mark.timeout(30)
MB = 1 << 20


def test_pool_allocates_first_fit_and_coalesces_what_is_freed() -> None:
    pool = shm.ShmPool("t", 4 * MB)
    a, b, c = (pool.reserve(MB) for _ in range(3))
    assert (a, b, c) == (0, MB, 2 * MB)
    assert pool.reserve(2 * MB) is None                      # only 1 MB left
    pool.claim(b, 0)                                          # nothing built on it: freed at once
    assert pool.usage() == (2 * MB, 2)
    pool.claim(a, 2)
    pool.release(a)
    assert pool.usage() == (2 * MB, 2)                        # one value of two still alive
    pool.release(a)
    assert pool.reserve(2 * MB) == 0                          # a and b merged into one free run
    pool.release(0)
    pool.release(c)
    assert pool.usage() == (0, 0) and pool.reserve(4 * MB) == 0
    assert pool.reserve(1) is None


def test_pool_is_anonymous_memory_not_a_file_in_dev_shm() -> None:
    before = set(os.listdir("/dev/shm"))
    pool = shm.ShmPool("anon", MB)
    assert set(os.listdir("/dev/shm")) == before
    assert os.readlink(f"/proc/self/fd/{pool.fd}").startswith("/memfd:omnid-anon")


class Env:
    def __init__(self) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="shm-", dir="/tmp"))
        self.received: queue.Queue[WorkItem] = queue.Queue()
        self.pool = shm.ShmPool("down", 8 * MB)
        self.listener = Listener(self.dir / "down.sock", self.admit, self.pool)
        self.listener.start()
        self.sender = Sender(lambda dst: self.dir / f"{dst}.sock", shm_min_bytes=64 * 1024)
        self.room = threading.Event()
        self.room.set()

    def admit(self, item: WorkItem) -> bool:
        self.room.wait(10)
        self.received.put(item)
        return True

    def send(self, **inputs: Any) -> bool:
        return self.sender.send("down", WorkItem(job="j", pipeline="p", src="up", inputs=inputs), abandon=lambda: False)

    def close(self) -> None:
        self.sender.close()
        shutil.rmtree(self.dir, ignore_errors=True)


@pytest.fixture
def env() -> Iterator[Env]:
    e = Env()
    yield e
    e.close()


def wait_for(cond: Any, timeout: float = 5.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        gc.collect()
        time.sleep(0.01)
    return bool(cond())


def test_large_values_arrive_whole_through_the_pool_and_free_it_when_dropped(env: Env) -> None:
    import torch
    arr = np.arange(200_000, dtype=np.float32).reshape(1000, 200)
    ten = torch.arange(300_000, dtype=torch.float32).to(torch.bfloat16).reshape(3, 100_000)
    blob = os.urandom(100_000)
    assert env.send(arr=arr, ten=ten, blob=blob, small=np.ones(4), text="hi")
    item = env.received.get(timeout=5)
    got = item.inputs
    assert np.array_equal(got["arr"], arr) and got["arr"].dtype == arr.dtype
    assert torch.equal(got["ten"], ten) and got["ten"].dtype == torch.bfloat16 and got["ten"].shape == ten.shape
    assert got["blob"] == blob and type(got["blob"]) is bytes
    assert got["text"] == "hi" and np.array_equal(got["small"], np.ones(4))
    used, slots = env.pool.usage()
    assert slots == 1 and used >= arr.nbytes + ten.numel() * 2 + len(blob)
    # The receiver's values sit on the pool itself (no copy): writing one shows in the pool.
    got["arr"][0, 0] = 42.0
    assert np.frombuffer(env.pool.mm, dtype=np.float32, count=1)[0] == 42.0      # arr is first in the slot
    view = got["ten"][1]                          # a view keeps the slot, even once its base is gone
    del item, got
    gc.collect()
    assert env.pool.usage()[1] == 1
    del view
    assert wait_for(lambda: env.pool.usage() == (0, 0))


def test_small_items_do_not_touch_the_pool(env: Env) -> None:
    assert env.send(text="x" * 1000, arr=np.ones(100))
    env.received.get(timeout=5)
    assert env.pool.usage() == (0, 0) and "down" not in env.sender._pools


def test_a_full_pool_is_backpressure(env: Env) -> None:
    first = env.pool.reserve(7 * MB)              # someone else's value holds most of the pool
    assert first is not None
    done = threading.Event()
    threading.Thread(target=lambda: (env.send(arr=np.ones(2 * MB // 8)), done.set()), daemon=True).start()
    assert not done.wait(0.5)                     # waits for room, as at a full queue
    env.pool.release(first)
    assert done.wait(5)
    assert env.received.get(timeout=5).inputs["arr"].sum() == 2 * MB // 8


def test_a_value_larger_than_the_pool_goes_through_the_socket(env: Env) -> None:
    big = np.ones(10 * MB // 8)
    assert env.send(arr=big)
    got = env.received.get(timeout=10).inputs["arr"]
    assert np.array_equal(got, big) and env.pool.usage() == (0, 0)


def test_a_slot_reserved_by_a_sender_that_went_away_is_freed(env: Env) -> None:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(str(env.dir / "down.sock"))
    wire.send_frame(sock, wire.RESERVE + wire.OFFSET.pack(MB))
    assert sock.recv(1) == wire.RESERVED
    sock.recv(8)
    assert env.pool.usage()[1] == 1
    sock.close()                                   # as a sender killed between asking and sending
    assert wait_for(lambda: env.pool.usage() == (0, 0))


def test_an_item_in_a_slot_that_was_not_reserved_is_refused(env: Env) -> None:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(str(env.dir / "down.sock"))
    enc = shm.encode(WorkItem(job="j", pipeline="p", src=None, inputs={}), 1)
    wire.send_frame(sock, wire.SHM_ITEM + wire.OFFSET.pack(0) + enc.payload)
    assert sock.recv(1) == b""                     # the connection is dropped; the listener goes on
    assert env.send(text="still serving")


def test_a_receiver_restart_gives_the_sender_the_new_pool(env: Env) -> None:
    assert env.send(arr=np.full(100_000, 1.0))
    env.received.get(timeout=5)
    env.listener._sock.close()
    pool2 = shm.ShmPool("down2", 8 * MB)
    received2: queue.Queue[WorkItem] = queue.Queue()
    listener2 = Listener(env.dir / "down.sock", lambda it: received2.put(it) is None, pool2)
    listener2.start()
    old = env.sender._pools.get("down")
    env.sender._drop("down")                      # as after the old receiver's connection broke
    assert env.send(arr=np.full(100_000, 2.0))
    assert received2.get(timeout=5).inputs["arr"][0] == 2.0
    assert env.sender._pools["down"] is not old
    assert wait_for(lambda: pool2.usage() == (0, 0))


def test_offered_windows_use_the_pool_and_report_a_full_one(env: Env) -> None:
    window = WorkItem(job="j", pipeline="p", src="up", inputs={"a": np.ones(50_000)}, window=0, last=False)
    assert env.sender.offer("down", window) is True
    env.received.get(timeout=5)
    held = env.pool.reserve(8 * MB - 64)
    assert env.sender.offer("down", window) is None          # no room: offered again later
    assert held is not None
    env.pool.release(held)
    assert env.sender.offer("down", window) is True


def test_a_value_collected_while_the_pool_is_locked_does_not_deadlock() -> None:
    pool = shm.ShmPool("gc", MB)
    slot = pool.reserve(1000)
    assert slot is not None
    pool.claim(slot, 1)
    with pool._lock:                       # as when the cyclic GC runs inside reserve()
        pool.collected(slot)               # the finalizer: must not wait for the lock
    assert pool.usage() == (0, 0)          # freed by the next call under the lock
