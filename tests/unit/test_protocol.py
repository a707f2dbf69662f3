"""`omnid.protocol`: the control messages between the supervisor and its stage workers.

They travel pickled over a pipe, so each must pickle and unpickle equal, stay immutable, and
stay small: the supervisor reads each message whole, which holds while a message fits in
PIPE_BUF (4096 bytes on Linux) and is written in one piece.
"""

from __future__ import annotations

import dataclasses
import pickle
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from omnid import protocol as P
from omnid.config import Config, DaemonConfig, EdgeConfig, PipelineConfig, StageConfig
from omnid.vocabulary import ErrorCode

PIPE_BUF = 4096
JOB = "0123456789ab"        # a job id: secrets.token_hex(6)


def a_config() -> Config:
    root = Path("/tmp/omnid-test")
    stage = StageConfig(name="post", engine="python", function="teststages:echo", python_path=(root,),
                        devices=(0,), defaults={"seconds": 0.1}, env={"A": "1"})
    return Config(source=root / "omnid.toml",
                  daemon=DaemonConfig(socket=root / "omnid.sock", state_dir=root / "state", lock_dir=root / "lock"),
                  stages={"post": stage, "post2": dataclasses.replace(stage, name="post2")},
                  pipelines={"chain": PipelineConfig(name="chain", stages=("post", "post2"),
                                                     edges=(EdgeConfig(src="post", dst="post2", map={"a": "b"}),),
                                                     timeout_s=30.0)})


def examples() -> dict[type, Any]:
    """One typical instance of every message (and of `WorkerSpec`)."""
    stats = P.QueueStats(enqueued=120, dequeued=118, dropped=2, depth=2, blocked_s=12.5, window_triggers=117)
    return {
        P.WorkerSpec: P.WorkerSpec(stage="post", config=a_config(), data_dir=Path("/tmp/omnid-test/data"),
                                   jobs_dir=Path("/tmp/omnid-test/jobs"), parent_pid=4242),
        P.Cancel: P.Cancel(job=JOB, reason="timed_out"),
        P.Forget: P.Forget(job=JOB),
        P.Resend: P.Resend(job=JOB, dst="draw", replica=1),
        P.Reroute: P.Reroute(job=JOB, stage="draw", replica=1),
        P.Deadline: P.Deadline(job=JOB, at=1_760_000_003.25),
        P.Shutdown: P.Shutdown(),
        P.Ready: P.Ready(pid=4243, load_s=12.25, info={"engine": "python", "devices": [0]}),
        P.LoadFailed: P.LoadFailed(error="ModuleNotFoundError: No module named 'x'"),
        P.QueueStats: stats,
        P.Heartbeat: P.Heartbeat(ts=1_760_000_000.123, stats=stats, running=(JOB, "ba9876543210"),
                                 gpu_memory_bytes=80 * 2**30, tracked_jobs=7),
        P.Admitted: P.Admitted(job=JOB, src="expand", depth=3),
        P.Started: P.Started(job=JOB),
        P.Progress: P.Progress(job=JOB, done=3, total=20),
        P.Segment: P.Segment(job=JOB, index=4, is_last=False, text="some words "),
        P.Output: P.Output(job=JOB, name="image", file="image.png", kind="image", content_type="image/png",
                           size=123456),
        P.Finished: P.Finished(job=JOB, elapsed_s=1.5),
        P.Delivered: P.Delivered(job=JOB, dst="draw"),
        P.Failed: P.Failed(job=JOB, error="ValueError: no", code=ErrorCode.EDGE_FAILED),
        P.ResendMissing: P.ResendMissing(job=JOB, dst="draw"),
        P.Stopped: P.Stopped(job=JOB),
        P.Batch: P.Batch(messages=(P.Started(job=JOB), P.Segment(job=JOB, index=0, is_last=False, text="a"))),
        P.Reconfigure: P.Reconfigure(config=a_config()),
        P.LogLines: P.LogLines(lines=(b"INFO loading", b"")),
        P.Usage: P.Usage(rss_bytes=512 * 2**20, cpu_percent=37.5),
    }


def protocol_dataclasses() -> list[type]:
    return [obj for obj in vars(P).values()
            if isinstance(obj, type) and dataclasses.is_dataclass(obj) and obj.__module__ == P.__name__]


def test_every_message_has_an_example() -> None:
    # A new message must be added to `examples()`, so the tests below cover it.
    assert set(protocol_dataclasses()) == set(examples())


@pytest.mark.parametrize("msg", list(examples().values()), ids=lambda m: type(m).__name__)
def test_message_pickles_and_unpickles_equal(msg: Any) -> None:
    back = pickle.loads(pickle.dumps(msg))
    assert back == msg and type(back) is type(msg)
    for f in dataclasses.fields(msg):
        assert getattr(back, f.name) == getattr(msg, f.name)


@pytest.mark.parametrize("cls", protocol_dataclasses(), ids=lambda c: c.__name__)
def test_messages_are_frozen(cls: type) -> None:
    assert cls.__dataclass_params__.frozen, f"{cls.__name__} must be frozen"
    msg = examples()[cls]
    for f in dataclasses.fields(msg):
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(msg, f.name, None)
    if not dataclasses.fields(msg):
        with pytest.raises(dataclasses.FrozenInstanceError):
            msg.extra = 1       # type: ignore[attr-defined]


def test_messages_with_fields_differ_by_value() -> None:
    # Equality (and hashing) is by value, field by field.
    assert P.Cancel(job="a") == P.Cancel(job="a", reason="cancelled")
    assert P.Cancel(job="a") != P.Cancel(job="b")
    assert P.Cancel(job="a") != P.Forget(job="a")
    assert hash(P.Started(job="a")) == hash(P.Started(job="a"))


def test_defaults() -> None:
    assert P.Cancel(job=JOB).reason == "cancelled"
    assert P.Failed(job=JOB, error="x").code == "stage_failed"
    assert P.Heartbeat(ts=1.0, stats=P.QueueStats()).running == ()
    assert P.QueueStats() == P.QueueStats(0, 0, 0, 0, 0.0, 0)
    assert P.Ready(pid=1, load_s=0.0).info == {} and P.Ready(pid=1, load_s=0.0).info is not P.Ready(1, 0.0).info


def test_worker_spec_socket_for() -> None:
    spec = examples()[P.WorkerSpec]
    assert spec.socket_for("draw") == Path("/tmp/omnid-test/data/draw.sock")
    assert spec.socket_for(spec.stage) == spec.data_dir / "post.sock"
    assert isinstance(spec.socket_for("x"), Path)


def test_exit_codes_are_distinct_and_not_generic() -> None:
    assert {P.EXIT_LOAD_FAILED, P.EXIT_ORPHANED} == {3, 4}
    assert not {P.EXIT_LOAD_FAILED, P.EXIT_ORPHANED} & {0, 1, 2}


@pytest.mark.parametrize("msg", [m for c, m in examples().items() if c is not P.WorkerSpec],
                         ids=lambda m: type(m).__name__)
def test_control_messages_fit_in_pipe_buf(msg: Any) -> None:
    assert len(pickle.dumps(msg)) < PIPE_BUF


def test_a_busy_workers_heartbeat_fits_in_pipe_buf() -> None:
    # A vllm stage with max_inflight = 64: 64 running job ids, large counters.
    stats = P.QueueStats(enqueued=2**40, dequeued=2**40 - 1, dropped=10**9, depth=10**6,
                         blocked_s=1e9 + 0.123, window_triggers=2**40)
    hb = P.Heartbeat(ts=1_760_000_000.123456, stats=stats,
                     running=tuple(f"{i:012x}" for i in range(64)), gpu_memory_bytes=141 * 2**30,
                     tracked_jobs=10**6)
    size = len(pickle.dumps(hb))
    assert size < PIPE_BUF, f"a Heartbeat pickles to {size} bytes"


def test_protocol_imports_nothing_heavy() -> None:
    code = ("import sys, omnid.protocol, omnid.dataplane.sender, omnid.dataplane.listener; "
            "print(sorted(m for m in ('torch', 'vllm', 'diffusers', 'numpy', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30, cwd="/")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_a_failure_carries_its_error_code_not_a_string() -> None:
    """`Failed.code` is an `ErrorCode` from the worker's `ctx.fail` to the scheduler (the JSON is made there)."""
    back = pickle.loads(pickle.dumps(P.Failed(job=JOB, error="no")))
    assert back.code is ErrorCode.STAGE_FAILED
    assert pickle.loads(pickle.dumps(examples()[P.Failed])).code is ErrorCode.EDGE_FAILED
