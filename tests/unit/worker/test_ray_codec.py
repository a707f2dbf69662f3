"""The pieces of a Ray-placed worker that need no cluster (omnid/worker/ray_actor.py): items in
their wire form (pickle + one uint8 array of large values) and back, bit-exact with dtype and
shape; read-only arrays stay zero-copy views, tensors become copies of their own; the outbox's
requests and answers; the control channel."""

from __future__ import annotations

import threading

import pytest

pytest.importorskip("ray", reason="the `ray` extra is not installed (pip install 'omnid[ray]')")
np = pytest.importorskip("numpy")
torch = pytest.importorskip("torch")

from omnid.dataplane.wire import WorkItem  # noqa: E402
from omnid.worker import ray_actor as R  # noqa: E402


def test_an_item_crosses_in_its_wire_form_bit_exact() -> None:
    bf16 = torch.randn(300, 700).to(torch.bfloat16)
    f16 = torch.full((1024, 1024), float("nan"), dtype=torch.float16)       # NaN payloads kept
    arr = np.arange(600_000, dtype=np.float32).reshape(600, 1000)
    blob = bytes(range(256)) * 8192
    item = WorkItem(job="j", pipeline="p", src="a", inputs={"bf16": bf16, "f16": f16, "arr": arr, "blob": blob,
                                                            "small": torch.ones(3), "text": "hi"})
    raw = R.to_raw(item, min_bytes=1 << 16)
    assert raw.buf is not None and raw.buf.dtype == np.uint8 and raw.size >= arr.nbytes + blob.__len__()
    ro = raw.buf.copy()
    ro.flags.writeable = False              # as Ray hands it over: read-only
    got = R.from_raw(raw.payload, ro).inputs
    assert got["bf16"].dtype == torch.bfloat16 and torch.equal(got["bf16"].view(torch.int16), bf16.view(torch.int16))
    assert torch.equal(got["f16"].view(torch.int16), f16.view(torch.int16))
    assert got["arr"].shape == (600, 1000) and np.array_equal(got["arr"], arr)
    assert not got["arr"].flags.writeable and np.shares_memory(got["arr"], ro)     # zero-copy, read-only
    got["bf16"][0, 0] = 1.0                 # a tensor of its own
    assert got["blob"] == blob and got["text"] == "hi" and torch.equal(got["small"], torch.ones(3))
    small = R.to_raw(WorkItem(job="j", pipeline="p", src=None, inputs={"x": 1}), min_bytes=1 << 16)
    assert small.buf is None and R.from_raw(small.payload, None).inputs == {"x": 1}


def test_outbox_requests_answers_and_forgotten_ones() -> None:
    box = R.Outbox()
    seq = box.submit("send", ("send", "b.0", None))
    assert box.result(seq, 0.01) == (False, None)
    assert box.take("quick", 0.01) == []
    taken = box.take("send", 0.01)
    assert taken == [(seq, ("send", "b.0", None))]
    threading.Timer(0.05, box.answer, (seq, True)).start()
    assert box.result(seq, 5.0) == (True, True)
    late = box.submit("quick", ("offer", "b.0", None))
    box.forget(late)
    box.answer(late, True)                  # a late answer to a forgotten request is dropped
    assert box.result(late, 0.01) == (False, None)


def test_queue_channel_both_ways() -> None:
    import pickle
    ch = R.QueueChannel()
    ch.send("a")
    ch.send_bytes(pickle.dumps("b"))
    assert ch.take(0.01) == ["a", "b"] and ch.taken.is_set()
    assert ch.take(0.01) == []
    ch.put("cancel")
    assert ch.recv() == "cancel"


def test_the_gpus_ray_gives_become_the_stage_devices() -> None:
    import copy
    from pathlib import Path

    from conftest import FIXTURES

    from omnid import config as C
    from omnid import protocol as P
    data = {"daemon": {"ray_address": "auto"},
            "stages": {"s": {"engine": "python", "function": "teststages:echo", "python_path": [str(FIXTURES)],
                             "placement": "ray", "ray": {"num_gpus": 2}}},
            "pipelines": {"p": {"stages": ["s"]}}}
    cfg = C.parse(copy.deepcopy(data), base=Path("/"))
    spec = P.WorkerSpec(stage="s", config=cfg, data_dir=Path("/tmp"), jobs_dir=Path("/tmp"), parent_pid=1)
    assert R.with_gpus(spec, 0) is spec
    seen = R.with_gpus(spec, 2)
    assert seen.config.stages["s"].devices == (0, 1) and seen.config.stages["s"].ray.num_gpus == 2
    assert spec.config.stages["s"].devices == ()        # the supervisor's own config is untouched
