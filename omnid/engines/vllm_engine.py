"""The `vllm` engine: an autoregressive LLM through vLLM's `LLMEngine`.

Runs in a stage worker's main thread; `step()` is one `LLMEngine.step()`
(a few ms on the tiny CPU model) and never blocks longer than one decode
step, so a cancel takes effect at the next step through `abort_request`.
Several requests are in flight at once when the stage's `max_inflight > 1`
(vLLM batches them).

By default (`engine_core = "process"`) it runs as `vllm serve` runs it: vLLM's engine core busy
loop (its scheduler and the model's forward) in a child process of this worker, which computes the
next step while this thread turns the last step's outputs into segments; `step()` then waits only
for outputs. `engine_core = "inline"` keeps the core in this thread (`distributed_executor_backend
="uni"`, no multiprocessing). Either way one stage is one process tree: the core starts in the
worker's process group, asks to die with the worker (PR_SET_PDEATHSIG, in `_run_engine_core`), and
is watched: a core that dies alone takes the worker down with
`EXIT_ENGINE_DIED`, so the supervisor restarts the stage and fails or retries its jobs. Token
deltas are streamed as text segments (`RequestOutputKind.DELTA`); the stage's
output `text` is the whole generation (prefixed by the prompt when the job
sets `include_prompt`). An input `messages` (a chat, as JSON text) replaces
`prompt`: it is rendered with the tokenizer's chat template.

Media inputs (`image`, `audio`, `video`; `omnid.media`) go to vLLM as `multi_modal_data`, in a
prompt the model's own processor renders with its chat template: a `{"type": "image"}` part per
item, where the template writes the model's placeholder, which vLLM's processing expands into the
item's tokens. They are decoded in `add` (audio resampled to the rate of the model's feature
extractor); a bad one fails its job alone. How each kind of input becomes vLLM's prompt (a chat,
tensors, media) is vllm_prompt.py's; the tensors' checks and the outputs' shapes, vllm_tensors.py's.
"""

from __future__ import annotations

import atexit
import itertools
import logging
import os
import queue
import sys
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from omnid import media as M
from omnid.config_types import StageConfig
from omnid.engines import vllm_compat
from omnid.engines.base import Engine, RequestContext
from omnid.engines.capabilities import VLLM, check_param
from omnid.engines.vllm_prompt import (
    DEFAULT_AUDIO_RATE,
    chat_prompt,
    load_processor,
    media_chat,
    media_inputs,
    tensor_prompt,
)
from omnid.engines.vllm_tap import TAP_CLASS, TAP_ERROR, unpack
from omnid.engines.vllm_tensors import TensorInputError, step_tensors, whole_tensors
from omnid.params import VLLM_OMNID_PARAMS, merged, parallel_size
from omnid.procwatch import ChildWatch, Exit
from omnid.protocol import EXIT_ENGINE_DIED
from omnid.vocabulary import ErrorCode


@dataclass
class _Request:
    ctx: RequestContext
    prefix: str
    max_tokens: int
    pieces: list[str] = field(default_factory=list)
    tokens: int = 0
    prompt_len: int = 0
    internal_id: str = ""                   # vLLM's own id of it (the tap's key)
    lora_id: int = 0                        # its adapter's id in vLLM (0: the base model)
    ids: list[int] = field(default_factory=list)        # generated token ids (when asked)
    prompt_ids: list[int] | None = None                 # the prompt's ids, once sent (when asked)
    rows: list[Any] = field(default_factory=list)       # hidden-state rows not yet in a segment
    rows_sent: int = 0                                  # hidden-state rows given in segments so far
    prompt_n: int = -1                                  # the prompt's length in tokens, once seen
    hidden: list[Any] = field(default_factory=list)     # every segment's rows (the final output)


def _run_engine_core(*args: Any, **kwargs: Any) -> None:
    """The engine core process's entry point (vLLM's `EngineCoreProc.run_engine_core`, which vLLM
    starts by spawn on a CPU): first asks the kernel for a SIGKILL when the stage worker dies, even
    by SIGKILL, so no core outlives its stage."""
    from omnid.prctl import die_with_parent

    die_with_parent(int(os.environ["OMNID_ENGINE_PARENT"]))     # (set by the worker before vLLM starts us)
    vllm_compat.allow_amx()                         # where the model runs, before it loads
    if os.environ.get("OMNID_LORA"):
        vllm_compat.fix_cpu_lora_no_adapter()       # where the model runs, before it loads
    traces = os.environ.get("OMNID_VLLM_OTLP_TRACES_ENDPOINT")     # `[daemon] tracing` (omnid.worker.tracing)
    if traces:
        _quiet_core_exporter(traces)
    from vllm.v1.engine.core import EngineCoreProc

    EngineCoreProc.run_engine_core(*args, **kwargs)    # (unpatched in this process: vLLM's own)


def _quiet_core_exporter(url: str) -> None:
    """vLLM's own span exporter in the engine core's process: the OTLP exporter logs each retry of a
    batch (six lines at start-up when nothing listens, each read as an error in the stage's log);
    instead its outage is said once, and once more when the receiver answers again (omnid.tracing's
    `QuietExporter`, the exporters of omnid's own processes)."""
    from omnid.tracing import QuietExporter

    logging.getLogger("opentelemetry.exporter.otlp").setLevel(logging.CRITICAL)
    try:
        import importlib
        otel: Any = importlib.import_module("vllm.tracing.otel")
    except ImportError:                 # (a vLLM without it: its retries stay silenced above)
        return
    make = getattr(otel, "get_span_exporter", None)
    if callable(make):
        otel.get_span_exporter = lambda endpoint: QuietExporter(make(endpoint), url)


def _own_engine_core_entry() -> None:
    """Make vLLM start its engine core through `_run_engine_core` (by name, so a spawned child
    imports this module for it)."""
    from vllm.v1.engine.core import EngineCoreProc

    os.environ["OMNID_ENGINE_PARENT"] = str(os.getpid())
    EngineCoreProc.run_engine_core = staticmethod(_run_engine_core)
    vllm_compat.core_liveness_hook(_monitor_engine_liveness)


def _monitor_engine_liveness(self: Any) -> None:
    """vLLM's own core monitor (its client's `MPClientEngineMonitor` thread), woken by an exit
    status only. vLLM's waits on the cores' sentinels and takes any wake for a death, then stops
    the cores itself: a wake that was no exit would kill a live core."""
    import threading

    ended = threading.Event()

    def died(proc: Any, end: Exit) -> None:
        if end.code != 0 and not self.manager_stopped.is_set():
            self.failed_proc_name = proc.name
        ended.set()

    watch = ChildWatch(self.processes, died, name="vllm-core-liveness").start()
    while not ended.wait(1.0) and not self.manager_stopped.is_set():
        pass
    watch.stop()
    self.shutdown()


REJECTED = ErrorCode.INPUT_REJECTED


def _rejected(e: BaseException) -> ErrorCode | None:
    """`input_rejected` when vLLM refused the request for what it holds (a ValueError or TypeError,
    or vLLM's own VLLMClientError, which newer vLLMs raise and which is neither: a prompt longer
    than the model, media its processor cannot take, a bad sampling value); None (the stage's
    failure) for anything else, a dead engine above all."""
    if vllm_compat.is_engine_dead(e):
        return None
    return REJECTED if vllm_compat.is_client_error(e) or isinstance(e, (ValueError, TypeError)) else None


def engine_args(stage: StageConfig) -> dict[str, Any]:
    """vLLM's EngineArgs for a stage: its `args` over omnid's defaults.

    The executor: one model in one process (`uni`: the engine core stays in this worker, one
    process tree) unless the stage asks for tensor or pipeline parallelism, which needs one process
    per GPU (`mp`); the worker's process group still holds them all. An explicit
    `distributed_executor_backend` in `args` wins (`--check` refuses `uni` with parallelism).
    """
    args: dict[str, Any] = {"model": str(stage.model), "disable_log_stats": True}
    # vLLM's own default (as `vllm serve` runs): the model torch.compile'd, on a CPU too, where
    # it makes a step 1.5-2x faster than eager for a first load of ~30 s (~10 s from the compile
    # cache). `enforce_eager = true` in `args` skips it.
    limits = stage.media.vllm_limits()
    if limits:                          # (--check refuses limit_mm_per_prompt in args: media says it)
        args["limit_mm_per_prompt"] = limits
    args.update(stage.args)
    # Jobs' priorities reach the engine (lower first; a running request of a lower priority is
    # preempted for a higher one when the KV cache is short): omnid's default, `"fcfs"` in args to opt out.
    args.setdefault("scheduling_policy", "priority")
    args.setdefault("distributed_executor_backend", "mp" if parallel_size(stage.args) > 1 else "uni")
    if "hidden_states" in stage.tensor_outputs:
        args["worker_extension_cls"] = TAP_CLASS        # the tap lives where the model runs
        # The tap is forward hooks, which neither a torch.compile'd graph nor a CUDA graph replay
        # calls: eager on a GPU, unless the stage says otherwise.
        args.setdefault("enforce_eager", True)
        if stage.hidden_prompt:
            # A prefix found in the cache is never computed: its rows would be missing.
            args["enable_prefix_caching"] = False
    if stage.takes_embeds:
        args["enable_prompt_embeds"] = True
    if stage.lora is not None:          # (--check refuses vLLM's LoRA args: the lora table says them)
        args.update(enable_lora=True, max_loras=stage.lora.max_loras, max_lora_rank=stage.lora.max_lora_rank)
    return args


COMPILE_ROOM = 256 << 20     # free bytes a torch.compile'd load wants where its caches go


def compile_cache_dirs() -> list[str]:
    """Where a torch.compile'd vLLM load writes: vLLM's compile cache (VLLM_CACHE_ROOT, by default
    ~/.cache/vllm) and inductor's (TORCHINDUCTOR_CACHE_DIR, by default /tmp/torchinductor_USER)."""
    import getpass
    import tempfile
    vllm_root = os.environ.get("VLLM_CACHE_ROOT") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "vllm")
    try:
        user = getpass.getuser()
    except Exception:
        user = str(os.getuid())
    inductor = os.environ.get("TORCHINDUCTOR_CACHE_DIR") or os.path.join(tempfile.gettempdir(),
                                                                         f"torchinductor_{user}")
    return [vllm_root, inductor]


def free_bytes(path: str) -> int:
    """Free bytes on the file system that holds `path` (or would: its nearest existing parent)."""
    while path and not os.path.exists(path):
        parent = os.path.dirname(path)
        if parent == path:
            break
        path = parent
    try:
        st = os.statvfs(path or "/")
    except OSError:
        return 0
    return st.f_bavail * st.f_frsize


def eager_if_no_room(args: dict[str, Any], stage_args: Mapping[str, Any]) -> str | None:
    """A compiled load whose caches cannot be written fails (inductor: ENOSPC), so a stage that did
    not choose runs eager when a cache's file system has under COMPILE_ROOM free. Returns why, for
    the log, or None."""
    if args.get("enforce_eager") or "enforce_eager" in stage_args:
        return None
    short = [(d, free_bytes(d)) for d in compile_cache_dirs()]
    short = [(d, n) for d, n in short if n < COMPILE_ROOM]
    if not short:
        return None
    args["enforce_eager"] = True
    where = ", ".join(f"{d} ({n >> 20} MiB free)" for d, n in short)
    return (f"the torch.compile caches have no room: {where}, under {COMPILE_ROOM >> 20} MiB; the model "
            f"runs eager (slower steps). Free space there, or set enforce_eager in the stage's args")


def cpu_threads(stage: StageConfig, args: Mapping[str, Any], environ: Any) -> int | None:
    """The model's OpenMP threads on a CPU: all of the worker's CPUs but one, as vLLM's own CPU
    executor reserves one for its scheduler and server. Here that one serves the worker's and the
    supervisor's work on each step's outputs; with every CPU in the forward, their turns preempt
    one of its threads, and all of them wait at its next barrier (measured on 2 cores: 1 thread
    gave 18.3-18.9 chats/s where 2 gave 13.8-14.9). None: leave it (a GPU stage, OMP_NUM_THREADS
    already set, by the stage's `env` say, or vLLM's mp executor, which sets its own per rank)."""
    if stage.devices or "OMP_NUM_THREADS" in environ or args.get("distributed_executor_backend") != "uni":
        return None
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    return max(1, cpus - 1)


PROGRESS_EVERY = 8      # tokens between two progress reports (and one at the end)


def _prepare_process(stage: StageConfig, own_core: bool) -> dict[str, Any]:
    """The worker's environment for vLLM (set before it is imported) and the stage's engine args."""
    if not stage.devices:
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    # The core's own process comes from `enable_multiprocessing` below. VLLM_ENABLE_V1_
    # MULTIPROCESSING stays as the worker's environment has it (0, unless the stage's `env`
    # says 1): on a CPU, vLLM reads 1 as "and the model in a third process" (its mp executor,
    # whose idle worker polls its queue at ~20 % of a core); with 0 the model runs in the
    # core's process, as `vllm serve` runs one GPU.
    if not own_core:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    args = engine_args(stage)
    if not own_core:
        vllm_compat.allow_amx()                     # (an inline core runs the model here)
    if stage.lora is not None:
        os.environ["OMNID_LORA"] = "1"              # the core's process fixes the CPU LoRA ops too
        vllm_compat.fix_cpu_lora_no_adapter()       # (an inline core runs the model here)
    traces = os.environ.get("OMNID_VLLM_OTLP_TRACES_ENDPOINT")     # `[daemon] tracing` (omnid.worker.tracing)
    if traces and not stage.args.get("disable_log_stats"):
        # vLLM's request spans: its tracing reads the request's stats (kept only with log_stats,
        # whose periodic log line is not kept: drop_logging_stat_logger); a stage that turns them
        # off has none.
        args.setdefault("otlp_traces_endpoint", traces)
        args["disable_log_stats"] = False
    threads = cpu_threads(stage, args, os.environ)
    if threads is not None:
        os.environ["OMP_NUM_THREADS"] = str(threads)    # the core's process is spawned with it
        if "torch" in sys.modules:                       # inline: the model runs here
            sys.modules["torch"].set_num_threads(threads)
    return args


class VllmEngine(Engine):
    capabilities = VLLM          # (engines/capabilities.py: what it can do)

    def __init__(self, stage: StageConfig) -> None:
        self._own_core = stage.engine_core == "process"
        self._step_ended: Callable[[], None] = _nothing     # the worker's (`on_step_ended`)
        args = _prepare_process(stage, self._own_core)
        warnings.filterwarnings("ignore", category=FutureWarning)
        from vllm import EngineArgs, LLMEngine, SamplingParams
        from vllm.sampling_params import RequestOutputKind

        if self._own_core:
            _own_engine_core_entry()

        self._SamplingParams = SamplingParams
        self._version = vllm_compat.running_version()
        self._delta = RequestOutputKind.DELTA
        self.stage = stage
        why = eager_if_no_room(args, stage.args)
        if why:
            logging.getLogger("omnid.engines.vllm").warning(why)
        quiet = None if args.get("disable_log_stats", True) else vllm_compat.stat_loggers()
        self.engine = LLMEngine.from_engine_args(EngineArgs(**args), stat_loggers=quiet,
                                                 enable_multiprocessing=self._own_core)
        if quiet is not None and "disable_log_stats" not in stage.args:
            vllm_compat.drop_logging_stat_logger(self.engine)   # statistics for the traces alone: no stats line
        self.default_max_tokens = int(stage.defaults.get("max_tokens", 16))
        self._prioritized = args.get("scheduling_policy") == "priority"
        self._ids = itertools.count()
        self._requests: dict[str, _Request] = {}
        self._by_job: dict[str, str] = {}
        self.media = stage.media
        self._processor: Any = None         # the model's processor: media prompts, its chat template
        if self.media.kinds:
            self._processor, rate = load_processor(stage)
            if rate is not None:
                self._audio_rate = rate
        self._render = vllm_compat.renderer(self.engine)
        # A chat template writes its own special tokens: a rendered chat is tokenized without them.
        self._render_chat = vllm_compat.renderer(self.engine, chat=True)
        # Tensors: the hidden-state tap (installed only when something asks for hidden states).
        self._tapped = "hidden_states" in stage.tensor_outputs
        self._watching: set[str] = set()            # internal ids the tap keeps rows of
        self._forget: list[str] = []                # watches to end at the next take
        self._by_internal: dict[str, str] = {}
        cfg = self.engine.model_config
        self._max_len = int(cfg.max_model_len)
        self._hidden = int(cfg.get_hidden_size())
        if self._tapped:
            self.engine.collective_rpc("omnid_tap_install", args=(list(stage.hidden_layers),))
        self._closing = False
        self._init_core()
        # LoRA adapters by name: vLLM's request for each (its own int id); those removed while a
        # running request still uses them are removed from vLLM when it ends.
        from vllm.lora.request import LoRARequest
        self._LoRARequest = LoRARequest
        self._loras: dict[str, Any] = {}
        self._lora_ids = itertools.count(1)
        self._retiring: dict[str, Any] = {}
        if stage.lora is not None:
            self.set_adapters(stage.adapters)
        self._warm_chat_template()

    def _warm_chat_template(self) -> None:
        """The chat template compiles now, not in the first chat's first token (~80 ms)."""
        try:
            self._render(chat_prompt(self.engine.get_tokenizer(), self.stage.model,
                                     [{"role": "user", "content": "hi"}]))
        except Exception:   # noqa: BLE001
            pass    # (no chat template: chats are refused per job)

    def _init_core(self) -> None:
        """The engine core's output queue (a step waits on it) and its process's watch, when it has one."""
        core_outputs = getattr(self.engine.engine_core, "outputs_queue", None) if self._own_core else None
        # (a queue.Queue, whose condition a step waits on beside `wake`; anything else: a plain step)
        self._core_outputs: queue.Queue[Any] | None = core_outputs if isinstance(core_outputs, queue.Queue) else None
        self._woken = False
        self._core_pids: list[int] = []
        self._core_watch: ChildWatch | None = None
        if self._own_core:
            self._watch_core()

    def _watch_core(self) -> None:
        """A thread that waits on the engine core processes; a core that dies while this worker lives
        (killed alone, or crashed) ends the worker, which the supervisor restarts. Dead means an exit
        status from the kernel (`omnid.procwatch`): a wake without one is logged and waited out."""
        procs = vllm_compat.core_processes(self.engine)
        self._core_pids = [p.pid for p in procs if p.pid is not None]
        if not procs:
            return
        stage = self.stage.name

        def died(proc: Any, ended: Exit) -> None:
            if self._closing or sys.is_finalizing():
                return                  # a shutdown is not a death
            print(f"omnid: the vLLM engine core process (pid {ended.pid}) of stage {stage!r} died "
                  f"({ended.describe()}): the stage worker exits to be restarted", file=sys.stderr, flush=True)
            os._exit(EXIT_ENGINE_DIED)

        self._core_watch = ChildWatch(procs, died, name="engine-core-watch").start()
        # At interpreter exit the watch stops before vLLM's own finalizer stops the core (atexit
        # runs the latest registration first): a script that never calls `close` still exits 0.
        atexit.register(self._core_watch.stop)

    def set_adapters(self, adapters: Mapping[str, Any]) -> None:
        """Register the adapters in force with vLLM (each loaded now, into its CPU cache: a bad one
        says so in the log at once, not in its first job), and remove the others once no running
        request uses them."""
        for name, path in adapters.items():
            known = self._loras.get(name)
            if known is not None and known.lora_path == str(path):
                continue
            if known is not None:
                self._retiring[name + "\0" + str(known.lora_int_id)] = known
            request = self._LoRARequest(name, next(self._lora_ids), str(path))
            self._loras[name] = request
            try:
                self.engine.add_lora(request)
            except Exception as e:
                logging.getLogger("omnid.engines.vllm").warning(f"adapter {name!r} ({path}) did not load: "
                                                                 f"{type(e).__name__}: {e}")
        for name in [n for n in self._loras if n not in adapters]:
            gone = self._loras.pop(name)
            self._retiring[name + "\0" + str(gone.lora_int_id)] = gone
        self._retire()

    def _retire(self) -> None:
        """Remove from vLLM the adapters no longer in force that no running request uses."""
        if not self._retiring:
            return
        used = {req.lora_id for req in self._requests.values()}
        for key, request in list(self._retiring.items()):
            if request.lora_int_id not in used:
                del self._retiring[key]
                try:
                    self.engine.remove_lora(request.lora_int_id)
                except Exception:
                    pass

    def on_step_ended(self, hook: Callable[[], None]) -> None:
        self._step_ended = hook

    def outputs_waiting(self) -> bool:
        # vLLM's SyncMPClient: a thread of its own puts each step's outputs on this queue.
        return self._core_outputs is not None and self._core_outputs.qsize() > 0

    def _wait_for_core(self) -> bool:
        """Wait for the core's next outputs, or a `wake`: True when outputs are there to take.

        (queue.Queue's own condition and deque: its `get` cannot also wait for a wake-up, and a
        `qsize()` in here would take the queue's lock twice.)"""
        q = self._core_outputs
        assert q is not None
        with q.not_empty:
            while not q.queue and not self._woken:
                q.not_empty.wait()
            self._woken = False
            return bool(q.queue)

    def wake(self) -> None:
        q = self._core_outputs
        if q is None:
            return
        with q.not_empty:
            self._woken = True
            q.not_empty.notify_all()

    def close(self) -> None:
        self._closing = True
        if self._core_watch is not None:
            self._core_watch.stop()
        if self._own_core:
            try:
                self.engine.engine_core.shutdown()
            except Exception:
                pass

    def info(self) -> dict[str, Any]:
        cfg = self.engine.model_config
        info: dict[str, Any] = {"model": str(self.stage.model), "vllm": self._version,
                                "dtype": str(getattr(cfg, "dtype", "")),
                                "max_model_len": getattr(cfg, "max_model_len", None),
                                "engine_core": {"where": self.stage.engine_core, "pids": self._core_pids},
                                # torch.compile'd (vLLM's default), or eager (asked, or no room for its caches)
                                "compiled": not getattr(cfg, "enforce_eager", True)}
        if not self.stage.devices and os.environ.get("OMP_NUM_THREADS", "").isdigit():
            info["threads"] = int(os.environ["OMP_NUM_THREADS"])     # the model's OpenMP threads
        if self.stage.tensor_outputs or self.stage.takes_embeds:
            # what the pipelines ask of it: GET /v1/stages shows whether the tap is in
            info["tensors"] = {"gives": sorted(self.stage.tensor_outputs), "takes_embeds": self.stage.takes_embeds,
                               "hidden_size": self._hidden, "tap": self._tapped,
                               **({"hidden_layers": list(self.stage.hidden_layers),
                                   "hidden_prompt": self.stage.hidden_prompt} if self._tapped else {})}
        if self.stage.lora is not None:
            info["adapters"] = sorted(self._loras)
        if self.media.kinds:
            info["media"] = {k: self.media.count(k) for k in self.media.kinds}
            if "audio" in self.media.kinds:
                info["audio_rate"] = self._audio_rate
        return info

    _prioritized = False        # scheduling_policy = "priority" (set at load)
    _audio_rate = DEFAULT_AUDIO_RATE    # the rate its media's audio is resampled to (the processor's, at load)

    def _priority(self, ctx: RequestContext) -> dict[str, int]:
        """The job's priority for `add_request` (0.28 and 0.32 take it alike); none under "fcfs",
        which ignores it."""
        return {"priority": ctx.priority} if self._prioritized and ctx.priority else {}

    def _adapter(self, ctx: RequestContext, adapter: Any) -> tuple[bool, Any]:
        """(False, None) after failing the job for an adapter the stage does not have; else (True, the
        LoRA request of the job's `adapter`, None when it asked for none)."""
        lora = self._loras.get(adapter) if isinstance(adapter, str) and adapter else None
        if adapter and lora is None:
            names = ", ".join(sorted(self._loras)) or "none"
            ctx.fail(f"stage {self.stage.name!r} has no adapter {adapter!r} (its adapters: {names})", REJECTED)
            return False, None
        return True, lora

    def _inputs(self, ctx: RequestContext) -> tuple[str, Any, Any, Any] | None:
        """The job's (prompt, messages, tensors, media), checked; None: the job failed (its input)."""
        prompt = ctx.inputs.get("prompt")
        messages = ctx.inputs.get("messages")
        try:
            tensors = tensor_prompt(ctx.inputs, self.stage, self.engine, self._hidden, self._max_len)
            media = media_inputs(ctx.inputs, self.stage, self._audio_rate)
        except (M.MediaError, TensorInputError) as e:
            ctx.fail(str(e), REJECTED)
            return None
        except Exception as e:          # a decoder's own failure: this job's input, not the engine
            ctx.fail(f"an input cannot be read: {type(e).__name__}: {e}", REJECTED)
            return None
        if tensors is not None and media:
            ctx.fail("media inputs go with a text prompt or messages, not with prompt_token_ids or prompt_embeds", REJECTED)
            return None
        if messages is not None or tensors is not None or (prompt is None and media):
            prompt = ""                 # a chat (rendered with the chat template), tensors, or media alone
        if not isinstance(prompt, str):
            ctx.fail(f"a vllm stage needs a text input \"prompt\" (or \"messages\", \"prompt_token_ids\", "
                     f"\"prompt_embeds\", or media); got {sorted(ctx.inputs) or 'no inputs'}", REJECTED)
            return None
        return prompt, messages, tensors, media

    def add(self, ctx: RequestContext) -> None:
        if (given := self._inputs(ctx)) is None:
            return
        prompt, messages, tensors, media = given
        params = merged(self.stage.defaults, ctx.params)
        # The door checked the job's values and --check the defaults; this guards what reaches vLLM.
        for key, value in params.items():
            if (why := check_param("vllm", key, value)) is not None:
                ctx.fail(f"{key} {why}, not {value!r}", REJECTED)
                return
        own = {key: params.pop(key) for key in VLLM_OMNID_PARAMS if key in params}
        include_prompt = bool(own.get("include_prompt", False))
        known, lora = self._adapter(ctx, own.get("adapter"))
        if not known:
            return
        template = own.get("prompt_template")
        text = str(template).replace("{prompt}", prompt) if template else prompt
        params.setdefault("max_tokens", self.default_max_tokens)
        if isinstance(params["max_tokens"], int) and params["max_tokens"] > self._max_len:
            # as `vllm serve` refuses it (the door says so first where it can know the window)
            ctx.fail(f"max_tokens={params['max_tokens']} cannot be greater than max_model_len={self._max_len}. "
                     "Please request fewer output tokens.", REJECTED)
            return
        try:
            if tensors is not None:
                rendered = tensors
            elif media or (messages is not None and self._processor is not None):
                rendered = self._render_chat(media_chat(self._processor, self.stage.name, messages, text, media))
            elif messages is not None:
                rendered = self._render(chat_prompt(self.engine.get_tokenizer(), self.stage.model, messages))
            else:
                rendered = self._render(text)
            sampling = self._SamplingParams(**params, output_kind=self._delta)
            request_id = f"{ctx.job}-{next(self._ids)}"
        except Exception as e:          # bad parameter values, media its processor cannot take
            ctx.fail(str(e) if isinstance(e, M.MediaError) else f"{type(e).__name__}: {e}", _rejected(e))
            return
        tapped = self._tapped and "hidden_states" in ctx.wants
        if tapped:
            # Before add_request: the request's first forward is tapped from its first step on.
            self.engine.collective_rpc("omnid_tap_watch", args=(request_id, self.stage.hidden_prompt))
        try:
            traced = {"trace_headers": ctx.trace_headers} if ctx.trace_headers else {}   # `[daemon] tracing`
            lora_arg = {"lora_request": lora} if lora is not None else {}
            internal_id = self.engine.add_request(request_id, rendered, sampling, **self._priority(ctx), **traced,
                                                  **lora_arg)
        except Exception as e:          # a prompt longer than the model, media vLLM's processing refuses
            if tapped:
                self._forget.append(request_id)
            ctx.fail(str(e) if isinstance(e, M.MediaError) else f"{type(e).__name__}: {e}", _rejected(e))
            return
        prefix = prompt if include_prompt else ""
        first = next(iter(tensors.values())) if tensors is not None else ()
        req = self._requests[request_id] = _Request(ctx, prefix, int(params["max_tokens"]), prompt_len=len(first),
                                                    internal_id=str(internal_id or request_id),
                                                    lora_id=lora.lora_int_id if lora is not None else 0)
        self._by_job[ctx.job] = request_id
        if tapped:
            self._watching.add(req.internal_id)
            self._by_internal[req.internal_id] = request_id

    def step(self) -> None:
        if self._core_outputs is not None and not self._wait_for_core():
            return                          # woken (a cancel, a new job): nothing from the core yet
        # Every step the core has made since the last look, not only the oldest: a core in a process
        # of its own steps on while this loop sends segments and windows, and one of its steps taken
        # per turn of the loop would leave the loop behind (a new request's first token queued behind
        # another's finished ones)
        steps = [self.engine.step()]
        while self.outputs_waiting():
            steps.append(self.engine.step())
        if self._watching or self._forget:
            self._take_rows()
        for i, outputs in enumerate(steps):
            if i:
                self._step_ended()      # each core step's tokens stay their own segment events
            self._outputs(outputs)

    def _outputs(self, outputs: list[Any]) -> None:
        """One core step's outputs, onto their requests: a segment each, and the finished ones."""
        for out in outputs:
            req = self._requests.get(out.request_id)
            if req is None:
                continue
            completion = out.outputs[0]
            if completion.text:
                req.pieces.append(completion.text)
            before, req.tokens = req.tokens, req.tokens + len(completion.token_ids)
            segment: dict[str, Any] = {"text": completion.text}
            if req.ctx.wants:
                segment.update(step_tensors(req, list(completion.token_ids), out.prompt_token_ids, self._tapped,
                                            self.stage.hidden_prompt))
            if out.finished:        # vLLM's own reason ("length": max_tokens or the context window), said
                req.ctx.finish_reason = str(completion.finish_reason) if completion.finish_reason else None
            req.ctx.segment(segment, is_last=out.finished)      # (with the last segment: a stream ends with it)
            if out.finished or req.tokens // PROGRESS_EVERY != before // PROGRESS_EVERY:
                req.ctx.progress(req.tokens, req.max_tokens)   # every few tokens: the segments tell each one
            if out.finished:
                self._drop(out.request_id)
                self._retire()
                generated = "".join(req.pieces)
                sep = " " if req.prefix and generated and not generated[0].isspace() else ""
                prompt_tokens = len(out.prompt_token_ids or ()) or req.prompt_len
                req.ctx.usage = {"prompt_tokens": prompt_tokens, "completion_tokens": req.tokens}
                final: dict[str, Any] = {"text": (req.prefix + sep + generated).strip()}
                if req.ctx.wants:
                    final.update(whole_tensors(req))
                req.ctx.finish(final)

    def _take_rows(self) -> None:
        """The tap's rows of the step just run, onto their requests (rank 0 answers)."""
        forget, self._forget = self._forget, []
        answers = self.engine.collective_rpc("omnid_tap_take", args=(forget, self._own_core))
        rows = next((a for a in answers if a is not None), None) or {}
        if TAP_ERROR in rows:
            for internal_id in list(self._watching):
                request_id = self._by_internal.get(internal_id)
                req = self._requests.get(request_id) if request_id is not None else None
                if req is not None:
                    req.ctx.fail(str(rows[TAP_ERROR]))      # the worker aborts it in the engine
            return
        for internal_id, block in rows.items():
            request_id = self._by_internal.get(internal_id)
            req = self._requests.get(request_id) if request_id is not None else None
            if req is not None:
                req.rows.append(unpack(block))

    def _drop(self, request_id: str) -> _Request | None:
        """Forget a request here and in the tap (at its next take)."""
        req = self._requests.pop(request_id, None)
        if req is None:
            return None
        self._by_job.pop(req.ctx.job, None)
        if req.internal_id in self._watching:
            self._watching.discard(req.internal_id)
            self._by_internal.pop(req.internal_id, None)
            self._forget.append(request_id)         # (the tap's key: the id it was watched by)
        return req

    def abort(self, job: str) -> None:
        request_id = self._by_job.get(job)
        if request_id is None:
            return
        self.engine.abort_request([request_id])
        # vLLM reports nothing more for an aborted request: complete it here.
        req = self._drop(request_id)
        if req is not None:
            req.ctx.stopped()
        self._retire()

    def has_work(self) -> bool:
        return bool(self._requests)


def _nothing() -> None:
    pass
