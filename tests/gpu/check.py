"""`make gpu-check`: every CUDA path omnid has, tried on this host's GPU with real daemons.

    python tests/gpu/check.py [--dry-run] [--only NAME,...] [--carry DIR] [--models DIR] [--json FILE]

Each check starts real daemons (`python -m omnid`, the harness of tests/conftest.py) with the
tiny models and python stages of tests/gpu/gpustages.py on GPU 0, and adds rows to one table:
check | result | figure. Results: `pass`, `FAIL` (the exit status is 1 if any), `skipped` (with
why: "vLLM not installed"), `goal missed` (a speed goal not met; reported, not a failure).

Without an NVIDIA GPU (no `nvidia-smi`, or it lists none) it prints one line saying so and exits 0
("skipped"). `--dry-run` runs the same checks on the CPU as far as they go without a GPU (device
visibility, exclusive stages, lock files, the tensor hand-off through the staged path, on small
tensors), to prove the harness itself; the rows that need a GPU say "skipped".

On a bare CUDA host (torch and transformers, no structlog, no diffusers, no registry) it takes what
`make gpu-wheels` carried in `--carry DIR`: DIR/wheels/*.whl, installed with pip (no index, no
dependencies) into DIR/site, which the daemons then import from (never into the host's Python);
DIR/models, the tiny SD and LLM models. Without carried models it builds them (omnid.tinymodels).

It runs in the check's own process (main thread) and blocks on the daemons it starts, each wait
with a deadline. It needs torch only inside the stage workers; nvidia-smi for the memory figures.
"""

from __future__ import annotations

import argparse
import fcntl
import grp
import importlib.util
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
MIB = 1 << 20

PASS, FAIL, SKIP, MISS = "pass", "FAIL", "skipped", "goal missed"


@dataclass
class Row:
    check: str
    result: str
    figure: str


def host_gpus() -> tuple[list[str], str]:
    """The GPUs `nvidia-smi -L` lists, or why there are none."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return [], "no NVIDIA GPU on this host (nvidia-smi not found)"
    try:
        out = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        return [], f"nvidia-smi -L failed: {e}"
    gpus = [line for line in out.stdout.splitlines() if line.startswith("GPU ")]
    if out.returncode != 0 or not gpus:
        return [], f"nvidia-smi lists no GPU ({(out.stderr or out.stdout).strip()[:200]})"
    return gpus, ""


# ------------------------------------------------------------------------- nvidia-smi


def smi_processes() -> dict[int, int]:
    """pid -> MiB used, per nvidia-smi's compute processes (every GPU)."""
    out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                         capture_output=True, text=True, timeout=30)
    procs: dict[int, int] = {}
    for line in out.stdout.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 2 and parts[0].isdigit() and parts[1].isdigit():
            procs[int(parts[0])] = procs.get(int(parts[0]), 0) + int(parts[1])
    return procs


def smi_used_mib(gpu: int = 0) -> int:
    """GPU `gpu`'s memory in use (MiB), all processes, per nvidia-smi."""
    out = subprocess.run(["nvidia-smi", "-i", str(gpu), "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                         capture_output=True, text=True, timeout=30)
    return int(out.stdout.strip().splitlines()[0])


# ------------------------------------------------------------------------- the run


class Ctx:
    """What every check shares: the mode, the models, a scratch folder, the harness."""

    def __init__(self, dry: bool, models: Path | None, work: Path) -> None:
        self.dry = dry
        self.models = models
        self.work = work
        import conftest  # tests/conftest.py: real daemons, deadlines (imported once sys.path has tests/)
        self.h = conftest
        self._n = 0

    def dir(self, name: str) -> Path:
        self._n += 1
        d = self.work / f"{self._n}{name[:6]}"
        d.mkdir(parents=True)
        return d

    @contextmanager
    def daemon(self, stages: dict[str, Any], pipelines: dict[str, Any], daemon: dict[str, Any] | None = None,
               *, d: Path | None = None, wait: bool = True, ready_timeout: float = 240,
               env: dict[str, str] | None = None) -> Iterator[Any]:
        """A running daemon; stopped at the end (SIGTERM, exit 0, no worker left, else it raises)."""
        h = self.h
        d = d or self.dir("d")
        cfg = h.daemon_config(d, stages, pipelines, {"admin_group": grp.getgrgid(os.getgid()).gr_name,
                                                     "shm_min_bytes": MIB, **(daemon or {})})
        log = d / f"omnid-{time.monotonic_ns()}.log"
        lock_dir = Path((daemon or {}).get("lock_dir", d / "lock"))
        rd = h.RunningDaemon(h.launch(cfg, log, env), d, cfg, d / "omnid.sock", d / "state", lock_dir, log)
        try:
            if wait:
                h.wait_ready(rd, timeout=ready_timeout)
            yield rd
        finally:
            problems = h.stop_and_check(rd)
            if problems:
                raise AssertionError("\n".join(problems))

    def job(self, rd: Any, pipeline: str, inputs: dict[str, Any] | None = None,
            params: dict[str, Any] | None = None, timeout: float = 120) -> dict[str, Any]:
        """Run one job to its end; its document (it must have succeeded)."""
        doc: dict[str, Any] = rd.wait(rd.submit(pipeline, inputs or {"text": "x"}, params), timeout)
        if doc["state"] != "succeeded":
            raise AssertionError(f"job of {pipeline} ended {doc['state']}: {doc.get('error')}")
        return doc

    def info(self, rd: Any, doc: dict[str, Any]) -> dict[str, Any]:
        data, _ = rd.client.output(doc["id"], "info")
        return dict(json.loads(data))


def py(function: str, **extra: Any) -> dict[str, Any]:
    return {"engine": "python", "function": f"gpustages:{function}", "python_path": [str(HERE)], **extra}


def lock_held(path: Path) -> bool:
    """Whether someone holds the flock of a GPU lock file (we try to take it, and let go at once)."""
    if not path.exists():
        return False
    with open(path, "rb") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        fcntl.flock(f, fcntl.LOCK_UN)
        return False


def wait_until(cond: Callable[[], Any], timeout: float, what: str) -> float:
    """Seconds until `cond()` held; AssertionError naming `what` past `timeout`."""
    start = time.monotonic()
    while not cond():
        if time.monotonic() - start > timeout:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.05)
    return time.monotonic() - start


# ------------------------------------------------------------------------- the checks


def check_devices(ctx: Ctx) -> list[Row]:
    """devices = [0] sees exactly GPU 0; devices = [] sees none."""
    stages = {"gpu0": py("visible", devices=[0]), "nogpu": py("visible", devices=[])}
    with ctx.daemon(stages, {"p0": {"stages": ["gpu0"]}, "pn": {"stages": ["nogpu"]}}) as rd:
        g = ctx.info(rd, ctx.job(rd, "p0"))
        n = ctx.info(rd, ctx.job(rd, "pn"))
    want = 0 if ctx.dry else 1
    ok = g["cvd"] == "0" and g["count"] == want and n["cvd"] == "" and n["count"] == 0
    return [Row("devices = [0] / []", PASS if ok else FAIL,
                f"[0]: CUDA_VISIBLE_DEVICES={g['cvd']!r}, torch sees {g['count']} "
                f"{('(' + g['uuids'][0] + ')') if g['uuids'] else ''}; []: {n['cvd']!r}, torch sees {n['count']}")]


def check_exclusive(ctx: Ctx) -> list[Row]:
    """An exclusive stage sharing its GPU is refused by --check; a second daemon on a held GPU
    is refused at start, naming the holder."""
    rows = []
    d = ctx.dir("x")
    cfg = ctx.h.daemon_config(d, {"x": py("visible", devices=[0], exclusive=True), "y": py("visible", devices=[0])},
                              {"p": {"stages": ["x", "y"]}})
    out = subprocess.run([sys.executable, "-m", "omnid", "--check", "-c", str(cfg)], capture_output=True, text=True,
                         timeout=60)
    said = (out.stdout + out.stderr).strip().splitlines()
    line = next((s for s in said if "exclusive" in s), said[-1] if said else "")
    rows.append(Row("exclusive stage sharing GPU 0", PASS if out.returncode == 2 and "exclusive" in line else FAIL,
                    f"--check exit {out.returncode}: {line.strip()[:160]}"))
    with ctx.daemon({"s": py("visible", devices=[0])}, {"p": {"stages": ["s"]}}) as first:
        d2 = ctx.dir("second")
        cfg2 = ctx.h.daemon_config(d2, {"t": py("visible", devices=[0])}, {"p": {"stages": ["t"]}},
                                   {"lock_dir": str(first.lock_dir)})
        try:
            second = subprocess.run([sys.executable, "-m", "omnid", "-c", str(cfg2)], capture_output=True,
                                    text=True, timeout=60)
            said2, rc = second.stdout + second.stderr, second.returncode
        except subprocess.TimeoutExpired:
            said2, rc = "still running after 60 s", -1
        holder = str(first.proc.pid)
        refusal = _said(next((s for s in said2.splitlines() if "GPU 0" in s), said2.strip()[-160:]))
        ok = rc not in (0, -1) and "GPU 0" in said2 and holder in said2
        rows.append(Row("second daemon on a held GPU", PASS if ok else FAIL,
                        f"exit {rc}, holder pid {holder} {'named' if holder in said2 else 'NOT named'}: "
                        f"{refusal.strip()[:160]}"))
    return rows


def _said(line: str) -> str:
    """A log line's message: a JSON record's `error` (or `event`), else the line."""
    try:
        record = json.loads(line[line.index("{"):])
    except ValueError:
        return line
    return str(record.get("error") or record.get("event") or line)


def check_locks_and_memory(ctx: Ctx) -> list[Row]:
    """Lock files held while loaded, released on sleep, stop and kill -9 of the supervisor; GPU
    memory per stage against nvidia-smi; a sleeping stage's memory back, and a wake restoring it."""
    rows: list[Row] = []
    mib = 64 if ctx.dry else 2048
    stages = {"hold": py("hold", devices=[0], defaults={"mib": mib})}
    pipelines = {"ph": {"stages": ["hold"]}}
    gpu = not ctx.dry
    before_mib = smi_used_mib() if gpu else 0
    d = ctx.dir("locks")
    lock = d / "lock" / "gpu0.lock"
    steps: list[str] = []
    memory: list[str] = []
    with ctx.daemon(stages, pipelines, d=d) as rd:
        ctx.job(rd, "ph")
        if not lock_held(lock):
            raise AssertionError(f"{lock} is not held while the stage is loaded")
        steps.append("held while loaded")
        pid = rd.stage_pid("hold")
        if gpu:
            wait_until(lambda: rd.stages()["hold"].get("gpu_memory_bytes"), 10, "a heartbeat with GPU memory")
            time.sleep(0.5)     # a heartbeat after the allocation settled
            ours = rd.stages()["hold"]["gpu_memory_bytes"]
            metric = _metric(rd, "omnid_stage_gpu_memory_bytes", "hold")
            theirs = smi_processes().get(pid)
            if theirs is None:
                rows.append(Row("GPU memory per stage", FAIL, f"nvidia-smi lists no process {pid} "
                                                           f"(it lists {sorted(smi_processes())})"))
            else:
                off = abs(ours - theirs * MIB) / (theirs * MIB)
                rows.append(Row("GPU memory per stage", PASS if off <= 0.10 and abs((metric or 0) - ours) <= 0.01 * ours else FAIL,
                                f"/v1/stages {ours / MIB:.0f} MiB, /metrics {(metric or 0) / MIB:.0f} MiB, "
                                f"nvidia-smi (pid {pid}) {theirs} MiB: {off:.1%} apart (goal <= 10 %)"))
            loaded_mib = smi_used_mib()
        rd.client.sleep_stage("hold")
        rd.wait_stage_state("hold", ("sleeping",), timeout=60)
        released = wait_until(lambda: not lock_held(lock), 10, "the lock to be let go on sleep")
        steps.append(f"free {released:.1f} s after sleep")
        if gpu:
            wait_until(lambda: pid not in smi_processes(), 10, f"worker {pid} to leave the GPU")
            asleep_mib = smi_used_mib()
        rd.client.wake_stage("hold")
        rd.wait_stage_state("hold", ("ready",), timeout=120)
        ctx.job(rd, "ph")
        if not lock_held(lock):
            raise AssertionError(f"{lock} is not held again after the wake")
        steps.append("held after wake")
        if gpu:
            woke_mib = smi_used_mib()
            freed = loaded_mib - asleep_mib
            ok = freed >= 0.9 * mib and abs(woke_mib - loaded_mib) <= 0.1 * (loaded_mib - before_mib)
            memory.append(f"GPU 0 used: {before_mib} MiB before, {loaded_mib} loaded, {asleep_mib} asleep "
                          f"({freed} freed of the stage's {mib}), {woke_mib} woken")
            rows.append(Row("sleep frees GPU memory, wake restores", PASS if ok else FAIL, memory[-1]))
    if lock_held(lock):
        raise AssertionError(f"{lock} still held after the daemon stopped")
    steps.append("free after stop")
    with ctx.daemon(stages, pipelines, d=d) as rd:
        ctx.job(rd, "ph")
        workers = rd.worker_pids()
        rd.expect_exit = ctx.h.ANY_EXIT
        os.kill(rd.proc.pid, signal.SIGKILL)
        rd.proc.wait(10)
        released = wait_until(lambda: not lock_held(lock), 15, "the lock to be let go after kill -9 of omnid")
        steps.append(f"free {released:.1f} s after kill -9 of omnid")
        left = ctx.h.wait_gone(workers, 15)
        if left:
            raise AssertionError(f"workers {left} outlived the kill -9 of omnid")
        if gpu:
            wait_until(lambda: not set(workers) & set(smi_processes()), 15, "the workers to leave the GPU")
            after = smi_used_mib()
            memory.append(f"GPU 0 used after kill -9: {after} MiB (before: {before_mib})")
            rows.append(Row("kill -9 of omnid frees GPU memory", PASS if after <= before_mib + 0.05 * mib else FAIL,
                            memory[-1]))
    rows.insert(0, Row("GPU lock files", PASS, "; ".join(steps)))
    if not gpu:
        rows += [Row("GPU memory per stage", SKIP, "dry run: no GPU"),
                 Row("sleep frees GPU memory, wake restores", SKIP, "dry run: no GPU")]
    return rows


def _metric(rd: Any, name: str, stage: str) -> float | None:
    from omnictl.client import parse_prometheus
    for sample in parse_prometheus(rd.client.metrics()).get(name, []):
        if sample["labels"].get("stage") == stage:
            return float(sample["value"])
    return None


def check_handoff(ctx: Ctx) -> list[Row]:
    """A CUDA tensor from one stage to the next on the same GPU (CUDA IPC), 256 MiB and 1 GiB:
    time and GB/s against an in-process device copy and the staged path; nothing left allocated."""
    sizes = (16, 64) if ctx.dry else (256, 1024)
    pool = 2 * max(sizes) + 64
    stages = {"make": py("make", devices=[0]), "take": py("take", devices=[0], shm_pool_mb=pool),
              "make_s": py("make", devices=[0], env={"OMNID_CUDA_IPC": "0"}),
              "take_s": py("take", devices=[0], shm_pool_mb=pool)}
    pipelines = {"ho": {"stages": ["make", "take"]}, "hs": {"stages": ["make_s", "take_s"]}}
    rows = []
    with ctx.daemon(stages, pipelines) as rd:
        def run(pipeline: str, mib: float) -> dict[str, Any]:
            info = ctx.info(rd, ctx.job(rd, pipeline, params={pipeline_first(pipeline): {"mib": mib}}))
            if mib > 0 and not (info["checksum_ok"] and info["on"] == info["gpu"]):
                raise AssertionError(f"{pipeline} {mib} MiB: checksum ok {info['checksum_ok']}, "
                                     f"made on {info['gpu']}, arrived on {info['on']}")
            return info

        def probe() -> tuple[int, int]:
            info = run("ho", 0)
            return info["make_allocated"], info["take_allocated"]

        base = probe()
        floor = statistics.median(run("ho", 1)["handoff_s"] for _ in range(5))   # 1 MiB: the stage-to-stage cost
        log = rd.state_dir / "logs" / "stages" / "make.log"
        for mib in sizes:
            run("ho", mib)                                   # warm-ups (the first open of a handle)
            run("hs", mib)
            ipc = [run("ho", mib) for _ in range(3)]
            staged = [run("hs", mib) for _ in range(2)]
            t_ipc = statistics.median(i["handoff_s"] for i in ipc)
            t_staged = statistics.median(i["handoff_s"] for i in staged)
            copy = statistics.median(i["copy_s"] for i in ipc)
            lent = ctx.dry or "lent by CUDA IPC" in log.read_text(errors="replace")
            try:
                wait_until(lambda: probe() == base, 5, "the hand-off's memory to be freed")
                left = "nothing left allocated"
            except AssertionError:
                left = f"left allocated: {probe()} bytes (make, take), before {base}"
            net = max(t_ipc - floor, 0.0)
            gbs = mib * MIB / t_ipc / 1e9
            name = f"CUDA hand-off {mib} MiB" if not ctx.dry else f"tensor hand-off {mib} MiB (CPU, staged)"
            ok = lent and left == "nothing left allocated"
            rows.append(Row(name, PASS if ok else FAIL,
                            f"{'lent by CUDA IPC' if lent and not ctx.dry else 'staged' if ctx.dry else 'NOT lent'}: "
                            f"{t_ipc * 1e3:.2f} ms ({gbs:.0f} GB/s) stage to stage; staged path "
                            f"{t_staged * 1e3:.1f} ms; in-process device copy {copy * 1e3:.3f} ms; {left}"))
            if not ctx.dry:
                ratio = net / copy if copy else float("inf")
                rows.append(Row(f"  {mib} MiB vs device copy", PASS if ratio <= 2 else MISS,
                                f"{net * 1e3:.3f} ms beyond a 1 MiB hand-off ({floor * 1e3:.2f} ms) = "
                                f"{ratio:.1f}x the device copy (goal <= 2x)"))
    return rows


def check_handoff_kill(ctx: Ctx) -> list[Row]:
    """kill -9 leaves nothing held: the receiver's copy outlives a kill -9 of the sender, and a
    kill -9 of the receiver holding it gives GPU 0 its memory back."""
    mib = 16 if ctx.dry else 512
    gpu = not ctx.dry
    stages = {"make": py("make", devices=[0]), "keep": py("take", devices=[0], defaults={"keep": True})}
    before = smi_used_mib() if gpu else 0
    with ctx.daemon(stages, {"hk": {"stages": ["make", "keep"]}}) as rd:
        sent = ctx.info(rd, ctx.job(rd, "hk", params={"make": {"mib": mib}}))
        if not sent["checksum_ok"]:
            raise AssertionError(f"the {mib} MiB tensor arrived damaged: {sent}")
        held = smi_used_mib() if gpu else 0
        for victim in ("make", "keep"):
            pid = rd.stage_pid(victim)
            os.kill(pid, signal.SIGKILL)
            wait_until(lambda: rd.stages()[victim]["pid"] not in (None, pid) and
                       rd.stages()[victim]["state"] == "ready", 60, f"stage {victim} back after kill -9")
            if gpu:
                wait_until(lambda: pid not in smi_processes(), 15, f"worker {pid} to leave the GPU")
            if victim == "make":
                kept = ctx.info(rd, ctx.job(rd, "hk", params={"make": {"mib": 0}, "keep": {"verify": True}}))
                if not kept.get("kept_ok"):
                    raise AssertionError(f"the receiver's copy changed after kill -9 of the sender: {kept}")
        after = smi_used_mib() if gpu else 0
    if not gpu:
        return [Row("kill -9 of sender and receiver", PASS, "dry run: the receiver's copy outlived the sender's "
                                                             "kill -9; memory figures need a GPU")]
    ok = after <= before + 0.05 * mib
    return [Row("kill -9 of sender and receiver", PASS if ok else FAIL,
                f"receiver's {mib} MiB copy intact after kill -9 of the sender; GPU 0 used {before} MiB before, "
                f"{held} held, {after} after kill -9 of the receiver")]


def pipeline_first(pipeline: str) -> str:
    return {"ho": "make", "hs": "make_s"}[pipeline]


def check_sd(ctx: Ctx) -> list[Row]:
    """The tiny SD pipeline on CUDA in fp16: 8 jobs one by one, then 8 at once (one batched call)."""
    name = "tiny SD, CUDA fp16, batched"
    if ctx.dry:
        return [Row(name, SKIP, "dry run: no GPU")]
    if importlib.util.find_spec("diffusers") is None:
        return [Row(name, SKIP, "diffusers not installed (make gpu-wheels carries it)")]
    if ctx.models is None or not (ctx.models / "sd").is_dir():
        return [Row(name, SKIP, "no tiny SD model")]
    stages = {"draw": {"engine": "diffusers", "model": str(ctx.models / "sd"), "devices": [0], "max_inflight": 8,
                       "args": {"dtype": "float16"}, "defaults": {"num_inference_steps": 8}}}
    with ctx.daemon(stages, {"t2i": {"stages": ["draw"]}}) as rd:
        device = rd.stages()["draw"].get("info", {}).get("device")
        ctx.job(rd, "t2i", {"prompt": "warm up"})
        start = time.monotonic()
        for i in range(8):
            ctx.job(rd, "t2i", {"prompt": f"a fox {i}"})
        single = 8 / (time.monotonic() - start)
        start = time.monotonic()
        ids = [rd.submit("t2i", {"prompt": f"a fox {i}"}) for i in range(8)]
        docs = [rd.wait(j, 120) for j in ids]
        batched = 8 / (time.monotonic() - start)
    ok = all(d["state"] == "succeeded" for d in docs) and device == "cuda"
    return [Row(name, PASS if ok else FAIL, f"on {device}: {single:.1f} jobs/s one by one, {batched:.1f} jobs/s "
                                            f"8 at once ({batched / single:.1f}x)")]


def check_vllm(ctx: Ctx) -> list[Row]:
    name = "vLLM stage on GPU 0"
    if ctx.dry:
        return [Row(name, SKIP, "dry run: no GPU")]
    if importlib.util.find_spec("vllm") is None:
        return [Row(name, SKIP, "vLLM not installed")]
    if ctx.models is None or not (ctx.models / "llm").is_dir():
        return [Row(name, SKIP, "no tiny LLM")]
    stages = {"gen": {"engine": "vllm", "model": str(ctx.models / "llm"), "devices": [0],
                      "args": {"gpu_memory_utilization": 0.1, "max_model_len": 256}}}
    with ctx.daemon(stages, {"chat": {"stages": ["gen"]}}, ready_timeout=280) as rd:
        snap = rd.stages()["gen"]
        start = time.monotonic()
        doc = ctx.job(rd, "chat", {"prompt": "hello"}, {"gen": {"max_tokens": 32, "ignore_eos": True}})
        took = time.monotonic() - start
        pid = snap["pid"]
        smi = smi_processes().get(pid)
    text, _ = rd.client.output(doc["id"], "text")
    return [Row(name, PASS if text else FAIL, f"loaded in {snap.get('load_s') or 0:.1f} s; 32 tokens in "
                                               f"{took * 1e3:.0f} ms; nvidia-smi {smi} MiB for pid {pid}")]


def check_ray(ctx: Ctx) -> list[Row]:
    name = "Ray-placed stage, num_gpus = 1"
    if importlib.util.find_spec("ray") is None:
        return [Row(name, SKIP, "ray not installed")]
    if ctx.dry:
        return [Row(name, SKIP, "dry run: no GPU")]
    import raycluster  # tests/raycluster.py: a head and a second raylet of its own, stopped by pid
    cluster = raycluster.start_cluster()      # the head finds the GPU itself (Ray's own detection)
    try:
        stages = {"rg": py("visible", placement="ray", ray={"num_gpus": 1})}
        with ctx.daemon(stages, {"pr": {"stages": ["rg"]}}, {"ray_address": cluster.address},
                        env=raycluster.CLIENT_ENV) as rd:
            seen = ctx.info(rd, ctx.job(rd, "pr"))
            given = (rd.stages()["rg"].get("ray") or {}).get("gpus")
    finally:
        cluster.stop()
    ok = seen["count"] == 1 and seen["cvd"] not in ("", "<unset>")
    return [Row(name, PASS if ok else FAIL, f"the actor sees CUDA_VISIBLE_DEVICES={seen['cvd']!r}, torch sees "
                                             f"{seen['count']} GPU; /v1/stages ray.gpus {given}")]


CHECKS: dict[str, Callable[[Ctx], list[Row]]] = {
    "devices": check_devices, "exclusive": check_exclusive, "locks": check_locks_and_memory,
    "handoff": check_handoff, "handoff-kill": check_handoff_kill, "sd": check_sd, "vllm": check_vllm, "ray": check_ray,
}


# ------------------------------------------------------------------------- models, table, main


def install_carried(carry: Path) -> str | None:
    """The carried wheels, installed into carry/site and put on the path (ours and the daemons');
    what it did, or None when nothing is carried."""
    wheels = sorted((carry / "wheels").glob("*.whl"))
    if not wheels:
        return None
    site = carry.resolve() / "site"
    out = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                          "--no-cache-dir", "--upgrade", "--target", str(site), *map(str, wheels)],
                         capture_output=True, text=True, timeout=300)
    if out.returncode != 0:
        raise SystemExit(f"gpu-check: installing the carried wheels failed:\n{out.stderr[-2000:]}")
    os.environ["PYTHONPATH"] = os.pathsep.join([str(site), *filter(None, [os.environ.get("PYTHONPATH")])])
    sys.path.insert(0, str(site))
    importlib.invalidate_caches()
    return f"{len(wheels)} carried wheels in {site}"


def find_models(explicit: Path | None, carry: Path) -> Path | None:
    """The tiny models: `--models`, the repository's .models, the carried ones, or built now (the
    LLM where vLLM is, SD where diffusers is; seconds) into .run/gpu-check/models."""
    if explicit is not None:
        return explicit
    if (ROOT / ".models" / ".built").exists():
        return ROOT / ".models"
    if (carry / "models" / "sd").is_dir() or (carry / "models" / "llm").is_dir():
        return carry / "models"
    kinds = [k for k, engine in (("llm", "vllm"), ("sd", "diffusers")) if importlib.util.find_spec(engine)]
    if not kinds or importlib.util.find_spec("transformers") is None:
        return None
    target = ROOT / ".run" / "gpu-check" / "models"
    code = ("import sys; from pathlib import Path; from omnid import tinymodels as t; t.offline_env(); "
            "[t.BUILDERS[k](Path(sys.argv[1]) / k) for k in sys.argv[2:] if not t.is_built(Path(sys.argv[1]) / k, k)]")
    out = subprocess.run([sys.executable, "-c", code, str(target), *kinds], capture_output=True, text=True,
                         timeout=300)
    if out.returncode != 0:
        print(f"gpu-check: building the tiny models failed:\n{out.stderr[-2000:]}", file=sys.stderr)
        return None
    return target


def table(rows: list[Row]) -> str:
    w1 = max(len("check"), *(len(r.check) for r in rows))
    w2 = max(len("result"), *(len(r.result) for r in rows))
    lines = [f"{'check':<{w1}} | {'result':<{w2}} | figure", f"{'-' * w1}-+-{'-' * w2}-+-{'-' * 40}"]
    lines += [f"{r.check:<{w1}} | {r.result:<{w2}} | {r.figure}" for r in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tests/gpu/check.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--dry-run", action="store_true", help="run what runs without a GPU, on the CPU")
    parser.add_argument("--only", default="", help=f"comma-separated checks: {', '.join(CHECKS)}")
    parser.add_argument("--carry", type=Path, default=ROOT / ".gpu-carry",
                        help="what `make gpu-wheels` carried: DIR/wheels, DIR/models (default: .gpu-carry)")
    parser.add_argument("--models", type=Path, default=None, help="the tiny models' folder (default: carried or built)")
    parser.add_argument("--json", type=Path, default=None, help="also write the rows here as JSON")
    args = parser.parse_args(argv)
    if not args.dry_run:
        gpus, why = host_gpus()
        if not gpus:
            print(f"gpu-check: skipped: {why}")
            return 0
    only = [c for c in args.only.split(",") if c]
    unknown = [c for c in only if c not in CHECKS]
    if unknown:
        parser.error(f"unknown checks {unknown}; there are {list(CHECKS)}")
    # The daemons and their workers import omnid (and gpustages) from this checkout.
    os.environ["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
    sys.path[:0] = [str(ROOT), str(ROOT / "tests")]
    carried = install_carried(args.carry)
    if carried:
        print(f"gpu-check: {carried}", file=sys.stderr)
    start = time.monotonic()
    work = Path(tempfile.mkdtemp(prefix="omnid-gpu-", dir="/tmp"))     # short: socket paths
    rows: list[Row] = []
    try:
        needs_models = not args.dry_run and (not only or {"sd", "vllm"} & set(only))
        ctx = Ctx(args.dry_run, find_models(args.models, args.carry) if needs_models else args.models, work)
        for name, check in CHECKS.items():
            if only and name not in only:
                continue
            t0 = time.monotonic()
            try:
                got = check(ctx)
            except Exception as e:          # one check's failure is its row; the others still run
                got = [Row(name, FAIL, f"{type(e).__name__}: {' '.join(str(e).split())[:400]}")]
            rows += got
            print(f"gpu-check: {name}: {', '.join(r.result for r in got)} ({time.monotonic() - t0:.0f} s)",
                  file=sys.stderr, flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    took = time.monotonic() - start
    print(table(rows))
    failed = [r for r in rows if r.result == FAIL]
    print(f"\n{len(rows)} rows, {len(failed)} failed, in {took:.0f} s{' (dry run, on the CPU)' if args.dry_run else ''}")
    if args.json is not None:
        args.json.write_text(json.dumps({"rows": [asdict(r) for r in rows], "seconds": took, "dry_run": args.dry_run},
                                        indent=1))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
