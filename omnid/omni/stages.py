"""The `python` stage functions of an omni pipeline: thinker (vLLM) → `talker` → `code2wav`.

Runs in a python stage worker's main thread; each function is a generator that the python engine
advances one segment at a time (so a cancel stops it between two codes or two audio chunks), and,
with `max_inflight > 1`, several jobs' generators in turn on one warm model. The model parts are
loaded once per worker, on the first job (`omnid.omni.loading`), from the stage's `model`: a
Qwen2.5-Omni checkpoint directory (the tiny one `make models` builds is `.models/omni`).

`talker` takes, from the thinker's edge (a window edge to stream, or `window = -1`):
- `prompt_ids`: the thinker's `prompt_token_ids` (its prompt as it tokenized it);
- `ids`: its `token_ids` (generated);
- `states`: its `hidden_states` with the prompt's rows first (the thinker stage's `hidden_prompt`),
  from the final norm (`hidden_layers = [-1]`, the default);
and yields one segment per codec token, `{"codes": int64 tensor of 1}`, starting as soon as the
thinker's first generated row is there. Parameters: `speaker` (a name in the checkpoint's
`spk_dict.pt`), `max_codes` (4096), `codes_per_token` (a bound on the codes per text token; a
random-weight talker never says its end code by itself), `repetition_penalty` (1.05).

`code2wav` takes `codes` (a window edge from the talker, best with a ramp such as
`[4, 8, 16, 25]`) and yields `{"audio": bytes}` chunks: a WAV header (24 kHz, 16-bit mono, the
length "to the end of the file", as streaming servers write it) with the first PCM, then PCM, so
the `audio` output is a WAV file that plays while it grows. Parameters: `speaker`, `num_steps`
(the DiT's ODE steps, 10), `guidance_scale` (0.5), `ramp` (codes each window makes final, the last
repeating: [6, 12, 24, 48]), `first_lookahead_codes` (4), `context_blocks` (2), `lookahead_blocks` (1),
`chunk_blocks` (fixed windows of that many blocks instead of the ramp), `seed` (0), `code_offset`
(0: the id of code 0 among its input's ids; a codec LM's `token_ids` start after its text tokens,
e.g. the tiny `tts` model's `codec_offset`, 1000).
"""

from __future__ import annotations

import struct
import threading
import time
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

from omnid.engines.python_sessions import Done
from omnid.omni.code2wav import SAMPLE_RATE, StreamingCode2Wav, Window, mels, vocode
from omnid.omni.talker import DEFAULT_MAX_CODES, DEFAULT_REPETITION_PENALTY, TalkerSession

DEFAULT_SPEAKER = "Chelsie"

_lock = threading.Lock()
_parts: dict[tuple[str, str], Any] = {}


def _model_dir(ctx: Any) -> Path:
    model = getattr(ctx, "model", None)
    if not model:
        raise ValueError(f"stage {ctx.stage!r} needs `model`: a Qwen2.5-Omni checkpoint directory")
    return Path(model)


def _cached(kind: str, model_dir: Path) -> Any:
    from omnid.omni import loading

    key = (kind, str(model_dir))
    with _lock:
        if key not in _parts:
            part = loading.load_talker(model_dir) if kind == "talker" else loading.load_token2wav(model_dir)
            _parts[key] = (part, loading.speakers(model_dir))
        return _parts[key]


def _speaker(speakers: Mapping[str, Any], params: Mapping[str, Any]) -> dict[str, Any]:
    name = str(params.get("speaker", DEFAULT_SPEAKER))
    if name not in speakers:
        raise ValueError(f"no speaker {name!r}; the checkpoint has {sorted(speakers)}")
    return speakers[name]  # type: ignore[no-any-return]


def _windows(value: Any) -> Iterable[Any]:
    """A streamed input's windows, or a whole input as one window."""
    return value if hasattr(value, "ready") and hasattr(value, "__next__") else [value]


def _flat(value: Any) -> list[int]:
    import torch

    return [int(t) for t in torch.as_tensor(value).reshape(-1).tolist()]


def _check_talker_inputs(inputs: Mapping[str, Any]) -> None:
    for key in ("prompt_ids", "ids", "states"):
        if key not in inputs:
            raise ValueError(f"the talker needs input {key!r} (map prompt_ids = \"prompt_token_ids\", "
                             "ids = \"token_ids\", states = \"hidden_states\" on its edge from the thinker)")


def _bound_codes(session: TalkerSession, per_token: Any, n_text: int) -> None:
    """The text has ended: `codes_per_token` (if given) bounds the session's codes by its length."""
    if per_token is not None:
        session.max_codes = min(session.max_codes, max(1, int(float(per_token) * n_text)))


def talker(inputs: Mapping[str, Any], params: Mapping[str, Any], ctx: Any) -> Iterator[dict[str, Any] | None]:
    import torch

    _check_talker_inputs(inputs)
    (model, embedding), speakers = _cached("talker", _model_dir(ctx))
    speaker = _speaker(speakers, params)
    max_codes = int(params.get("max_codes", DEFAULT_MAX_CODES))
    per_token = params.get("codes_per_token")
    prompt = _flat(next(iter(_windows(inputs["prompt_ids"]))))
    rows_in = iter(_windows(inputs["states"]))
    ids: list[int] = []
    rows: list[Any] = []
    n_rows = 0
    session: TalkerSession | None = None
    fed = 0                                     # generated tokens fed to the session (the first at prefill)

    def codes_now() -> Iterator[dict[str, Any]]:
        assert session is not None
        while (code := session.step()) is not None:
            yield {"codes": torch.tensor([code], dtype=torch.int64)}

    for window_ids in _windows(inputs["ids"]):
        ids.extend(_flat(window_ids))
        window_rows = next(rows_in, None)
        if window_rows is not None:
            window_rows = torch.as_tensor(window_rows)
            rows.append(window_rows)
            n_rows += window_rows.shape[0]
        if n_rows <= len(prompt) or not ids:
            yield None                          # nothing to say yet: the engine comes back with the next window
            continue
        all_rows = torch.cat(rows) if len(rows) > 1 else rows[0]
        rows = [all_rows]
        if session is None:
            if all_rows.shape[0] < len(prompt) + 1:
                yield None
                continue
            session = TalkerSession(model, embedding, speaker, prompt, all_rows[:len(prompt)], ids[0],
                                    all_rows[len(prompt)], max_codes=max_codes,
                                    repetition_penalty=float(params.get("repetition_penalty",
                                                                        DEFAULT_REPETITION_PENALTY)))
            fed = 1
        # reply(g_j) needs g_j's row: row len(prompt) + j
        while fed < len(ids) and len(prompt) + fed < all_rows.shape[0]:
            session.feed(ids[fed], all_rows[len(prompt) + fed])
            fed += 1
        said = False
        for segment in codes_now():
            said = True
            yield segment
        if not said:
            yield None
    if session is None:
        raise ValueError(f"the thinker gave {len(ids)} tokens and {n_rows} hidden rows for a prompt of "
                         f"{len(prompt)} tokens: the talker needs the prompt's rows (hidden_prompt = true) "
                         "and at least one generated token")
    session.end_text()
    _bound_codes(session, per_token, len(ids))
    yield from codes_now()


class _Feed:
    """One input of a session: a streamed input's windows, or a whole input as one window; read
    without blocking (`ready` first)."""

    def __init__(self, value: Any) -> None:
        self._stream = value if hasattr(value, "ready") and hasattr(value, "__next__") else None
        self._whole: list[Any] = [] if self._stream is not None else [value]
        self.ended = False

    def ready(self) -> bool:
        return not self.ended and (self._stream.ready() if self._stream is not None else True)

    def take(self) -> tuple[bool, Any]:
        """(True, the next window) or (False, None) at its end; call only when `ready`."""
        if self._stream is not None:
            value = next(self._stream, _END)
        else:
            value = self._whole.pop() if self._whole else _END
        if value is _END:
            self.ended = True
            return False, None
        return True, value


_END = object()


class _TalkerJob:
    """One job in the talker stage: its thinker inputs as they come, then its TalkerSession."""

    def __init__(self, inputs: Mapping[str, Any], params: Mapping[str, Any], speaker: Mapping[str, Any]) -> None:
        self.prompt_in, self.ids_in, self.states_in = (_Feed(inputs[k]) for k in ("prompt_ids", "ids", "states"))
        self.speaker = speaker
        self.max_codes = int(params.get("max_codes", DEFAULT_MAX_CODES))
        self.per_token = params.get("codes_per_token")
        self.penalty = float(params.get("repetition_penalty", DEFAULT_REPETITION_PENALTY))
        self.prompt: list[int] | None = None
        self.ids: list[int] = []
        self.rows: Any = None
        self.fed = 0                            # generated tokens fed to the session (the first at prefill)
        self.session: TalkerSession | None = None
        self.slot: int | None = None

    def absorb(self) -> None:
        """Take every window that is here (never blocks)."""
        import torch

        if self.prompt is None and self.prompt_in.ready():
            ok, value = self.prompt_in.take()
            if ok:
                self.prompt = _flat(value)
        while self.ids_in.ready():
            ok, window = self.ids_in.take()
            if not ok:
                break
            self.ids.extend(_flat(window))
            ok, rows = self.states_in.take() if self.states_in.ready() else (False, None)
            if ok:
                rows = torch.as_tensor(rows)
                self.rows = rows if self.rows is None else torch.cat([self.rows, rows])

    @property
    def text_over(self) -> bool:
        return self.ids_in.ended

    def can_step(self) -> bool:
        if self.ids_in.ready() or self.prompt_in.ready():
            return True
        if self.session is None or self.session.done:
            return self.text_over           # (to start on what came, or fail; to say it is done)
        return self.session.ready() or (self.text_over and not self.session.text_ended)


CODES_PER_STEP = 4      # a talker step's forwards for a session whose inputs are there: up to 4 codes a segment


class Talker:
    """The talker stage as sessions (`sessions = "omnid.omni.stages:Talker"`): every live job's
    next code from one batched forward per step (`TalkerBatch`), the codes each as its session
    alone would give; a session whose next inputs are already there (the thinker ahead, or done)
    makes up to `CODES_PER_STEP` codes a step, one segment (fewer steps and segments a code).
    Inputs and parameters as `talker`'s."""

    produces = ("tensor",)          # its `codes` (read from here by the config: what a last stage gives)

    def __init__(self, load: Any) -> None:
        from omnid.omni.talker_batch import TalkerBatch

        self.stage = load.stage
        _loader("talker")(load)                 # (logs "omni part loaded", as the load hooks do)
        (self.model, self.embedding), self.speakers = _cached("talker", _model_dir(load))
        # a slot (KV cache rows) for each job the stage runs at once
        self.batch = TalkerBatch(self.model, slots=max(1, int(load.max_inflight)))

    def open(self, inputs: Mapping[str, Any], params: Mapping[str, Any], ctx: Any) -> _TalkerJob:
        _check_talker_inputs(inputs)
        return _TalkerJob(inputs, params, _speaker(self.speakers, params))

    def ready(self, job: _TalkerJob) -> bool:
        return job.can_step()

    def step(self, jobs: list[_TalkerJob]) -> list[Any]:
        import torch

        results: list[Any] = [None] * len(jobs)
        decode: list[tuple[int, _TalkerJob, Any, int]] = []
        for i, job in enumerate(jobs):
            try:
                job.absorb()
                self._start(job)
            except Exception as e:              # (that job alone)
                results[i] = e
                continue
            s = job.session
            if s is None:
                if job.text_over:
                    results[i] = ValueError(
                        f"the thinker gave {len(job.ids)} tokens and {0 if job.rows is None else job.rows.shape[0]} "
                        f"hidden rows for a prompt of {len(job.prompt or [])} tokens: the talker needs the prompt's "
                        "rows (hidden_prompt = true) and at least one generated token")
                continue
            self._feed(job)
            if s.done:                          # (it reads its windows to their end, then ends)
                results[i] = Done() if job.text_over else None
            elif not s.wants_forward():
                results[i] = self._code(job, s.pick())
            elif (step := s.next_input()) is not None:
                decode.append((i, job, step[0], step[1]))
        codes: dict[int, list[int]] = {}
        for round_ in range(CODES_PER_STEP):    # (the sessions whose next input is here go on, one forward a code)
            if not decode:
                break
            logits = self.batch.decode([int(job.slot or 0) for _, job, _, _ in decode],
                                       torch.stack([row for _, _, row, _ in decode]), [p for _, _, _, p in decode])
            again: list[tuple[int, _TalkerJob, Any, int]] = []
            for (i, job, _, _), row in zip(decode, logits):
                s = job.session
                assert s is not None
                s.take_logits(row)
                code = s.pick()
                if code is not None:
                    codes.setdefault(i, []).append(code)
                    if round_ + 1 < CODES_PER_STEP and s.has_input() and (step := s.next_input()) is not None:
                        again.append((i, job, step[0], step[1]))
                elif i not in codes:
                    results[i] = self._code(job, None)
            decode = again
        for job_i, job_codes in codes.items():
            results[job_i] = {"codes": torch.tensor(job_codes, dtype=torch.int64)}
        return results

    def _start(self, job: _TalkerJob) -> None:
        """The prefill, once the prompt's rows and the first generated token's are here."""
        if job.session is not None or job.prompt is None or not job.ids or job.rows is None:
            return
        n = len(job.prompt)
        if job.rows.shape[0] < n + 1:
            return
        if self.batch.free == 0:
            raise RuntimeError(f"the talker has no free slot: all {len(self.batch.lengths)} (max_inflight) hold a session")
        job.session = TalkerSession(self.model, self.embedding, job.speaker, job.prompt, job.rows[:n], job.ids[0],
                                    job.rows[n], max_codes=job.max_codes, repetition_penalty=job.penalty)
        job.slot = self.batch.admit(job.session.cache)
        job.fed = 1

    def _feed(self, job: _TalkerJob) -> None:
        s = job.session
        assert s is not None and job.prompt is not None
        n = len(job.prompt)
        while job.fed < len(job.ids) and n + job.fed < job.rows.shape[0]:
            s.feed(job.ids[job.fed], job.rows[n + job.fed])
            job.fed += 1
        if job.text_over and not s.text_ended:
            s.end_text()
            _bound_codes(s, job.per_token, len(job.ids))

    def _code(self, job: _TalkerJob, code: int | None) -> Any:
        import torch

        if code is None:
            return Done() if job.session is not None and job.session.done and job.text_over else None
        return {"codes": torch.tensor([code], dtype=torch.int64)}

    def close(self, job: _TalkerJob) -> None:
        if job.slot is not None:
            self.batch.release(job.slot)
            job.slot = None
        job.session = None


def wav_header(rate: int = SAMPLE_RATE) -> bytes:
    """A 16-bit mono WAV header whose sizes say "to the end of the file" (a stream's length is not
    known when it starts): the header and every PCM chunk after it, concatenated, are the WAV."""
    return (b"RIFF" + struct.pack("<I", 0xFFFFFFFF) + b"WAVE"
            + b"fmt " + struct.pack("<IHHIIHH", 16, 1, 1, rate, rate * 2, 2, 16)
            + b"data" + struct.pack("<I", 0xFFFFFFFF))


def pcm16(samples: Any) -> bytes:
    """Float samples in [-1, 1] as little-endian 16-bit PCM."""
    import torch

    return bytes((torch.as_tensor(samples).float().clamp(-1, 1) * 32767).round().to(torch.int16).numpy().tobytes())


def _decoder(model: Any, speakers: Mapping[str, Any], inputs: Mapping[str, Any], params: Mapping[str, Any]) -> StreamingCode2Wav:
    """A job's code2wav decoder, from its parameters."""
    if "codes" not in inputs:
        raise ValueError("code2wav needs input 'codes' (the talker's codec tokens)")
    return StreamingCode2Wav(
        model, _speaker(speakers, params), num_steps=int(params.get("num_steps", 10)),
        guidance_scale=float(params.get("guidance_scale", 0.5)),
        chunk_blocks=None if params.get("chunk_blocks") is None else int(params["chunk_blocks"]),
        ramp=_ramp(params.get("ramp")),
        first_lookahead_codes=None if params.get("first_lookahead_codes") is None
        else int(params["first_lookahead_codes"]),
        context_blocks=int(params.get("context_blocks", 2)), lookahead_blocks=int(params.get("lookahead_blocks", 1)),
        seed=int(params.get("seed", 0)))


def _ramp(value: Any) -> tuple[int, ...] | None:
    """code2wav's `ramp`: codes made final by each window, the last repeating (a list of positive ints)."""
    if value is None:
        return None
    sizes = value if isinstance(value, (list, tuple)) else [value]
    if not sizes or not all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in sizes):
        raise ValueError(f"ramp must be a list of positive integers (codes a window makes final), not {value!r}")
    return tuple(sizes)


def _codec_codes(window: Any, offset: int, n_codes: int) -> list[int]:
    """A window of codes as the codec's own ids (`code_offset` taken off); ValueError for any that is none."""
    codes = [c - offset for c in _flat(window)]
    bad = [c + offset for c in codes if not 0 <= c < n_codes]
    if bad:
        raise ValueError(f"codes {bad[:5]} are not codec codes: with code_offset {offset} they must be in "
                         f"[{offset}, {offset + n_codes})")
    return codes


def code2wav(inputs: Mapping[str, Any], params: Mapping[str, Any], ctx: Any) -> Iterator[dict[str, Any] | None]:
    model, speakers = _cached("token2wav", _model_dir(ctx))
    decoder = _decoder(model, speakers, inputs, params)
    offset = int(params.get("code_offset", 0))
    n_codes = int(model.code2wav_dit_model.config.num_embeds)
    header = wav_header()
    for window in _windows(inputs["codes"]):
        chunks = decoder.push(_codec_codes(window, offset, n_codes))
        if not chunks:
            yield None                          # not a whole block yet: back with the next window
        for pcm in chunks:
            yield {"audio": header + pcm16(pcm)}
            header = b""
    for pcm in decoder.finish():
        yield {"audio": header + pcm16(pcm)}
        header = b""
    if header:
        yield {"audio": header}                 # no codes at all: an empty WAV


# Ready means loaded: each stage's weights are read as it starts (PythonEngine calls `load`),
# not on its first job; `lazy = true` on the stage leaves that to the first job.
def _loader(kind: str) -> Any:
    def load(ctx: Any) -> None:
        import structlog
        t0 = time.perf_counter()
        _cached(kind, _model_dir(ctx))
        structlog.get_logger("omnid.omni").info("omni part loaded", part=kind, stage=ctx.stage,
                                                 load_s=round(time.perf_counter() - t0, 3))
    return load


talker.load = _loader("talker")            # type: ignore[attr-defined]
code2wav.load = _loader("token2wav")       # type: ignore[attr-defined]


class _Code2WavJob:
    """One job in the code2wav stage: its codes as they come, its decoder, its WAV header owed."""

    def __init__(self, codes: Any, decoder: StreamingCode2Wav, offset: int, n_codes: int) -> None:
        self.codes_in = _Feed(codes)
        self.decoder = decoder
        self.offset = offset
        self.n_codes = n_codes
        self.header = wav_header()
        self.window: Window | None = None
        self.opened = time.monotonic()
        self.first_out: float | None = None     # when its first audio went out
        self.audio_s = 0.0                      # the audio it has given
        self.bad: Exception | None = None       # what was wrong with its codes (the job fails with it)

    @property
    def deadline(self) -> float:
        """When its listener runs out of audio (played from its first packet on): the job whose
        audio is due first decodes first; one with none yet is due since it opened."""
        return self.opened if self.first_out is None else self.first_out + self.audio_s

    def absorb(self) -> None:
        """Take the codes that came (raises what was wrong with them, once taken: at every call)."""
        if self.bad is not None:
            raise self.bad
        try:
            while self.codes_in.ready():
                ok, window = self.codes_in.take()
                if not ok:
                    self.decoder.finished = True
                    break
                self.decoder.codes.extend(_codec_codes(window, self.offset, self.n_codes))
        except Exception as e:
            self.bad = e
            raise

    def can_step(self) -> bool:
        """A step would decode (a whole window's codes are here, or the last ones) or end it. Its
        codes come one segment each: a step for each (that found no window) cost the tts stage's
        code2wav a step per code, between its decodes, on the cores the codec LM needed."""
        try:
            self.absorb()
        except Exception:
            return True                         # (the step says what is wrong with them)
        return self.decoder.finished or self.decoder.next_window() is not None

    def chunk(self, pcm: Any) -> dict[str, Any]:
        audio, self.header = self.header + pcm16(pcm), b""
        if self.first_out is None:
            self.first_out = time.monotonic()
        self.audio_s += len(pcm) / SAMPLE_RATE
        return {"audio": audio}


class Code2Wav:
    """The code2wav stage as sessions (`sessions = "omnid.omni.stages:Code2Wav"`): each step decodes
    the ready windows of the job whose audio is due first (`deadline`: a listener's clock) and of
    every job whose window matches it (`ode_key`), in one batched DiT ODE, and their vocoder inputs
    of one length in one BigVGAN call; the other jobs' windows wait for the next step (so a new
    job's small first window is not queued behind the others' big ones). Each job's audio is what
    its decoder alone gives (within float rounding). Inputs and parameters as `code2wav`'s."""

    produces = ("audio",)           # its WAV (read from here by the config: what a last stage gives)

    def __init__(self, load: Any) -> None:
        _loader("token2wav")(load)              # (logs "omni part loaded", as the load hooks do)
        self.model, self.speakers = _cached("token2wav", _model_dir(load))
        self.n_codes = int(self.model.code2wav_dit_model.config.num_embeds)
        self.live: set[_Code2WavJob] = set()    # the sessions open (streams playing or about to)

    def open(self, inputs: Mapping[str, Any], params: Mapping[str, Any], ctx: Any) -> _Code2WavJob:
        decoder = _decoder(self.model, self.speakers, inputs, params)
        busy_first = params.get("busy_first")
        if busy_first is not None and self.live and int(busy_first) > decoder.ramp[0]:
            # other streams share the cores: its second window comes slower than it would alone, so its
            # first one holds more audio (its first packet a little later, no gap after it)
            decoder.ramp = (int(busy_first), *decoder.ramp[1:])
        job = _Code2WavJob(inputs["codes"], decoder, int(params.get("code_offset", 0)), self.n_codes)
        self.live.add(job)
        return job

    def close(self, job: _Code2WavJob) -> None:
        self.live.discard(job)

    def ready(self, job: _Code2WavJob) -> bool:
        return job.can_step()

    def step(self, jobs: list[_Code2WavJob]) -> list[Any]:
        results: list[Any] = [None] * len(jobs)
        groups: dict[tuple[Any, ...], list[int]] = {}
        for i, job in enumerate(jobs):
            try:
                job.absorb()
            except Exception as e:
                results[i] = e
                continue
            job.window = job.decoder.next_window()
            if job.window is not None:
                groups.setdefault(job.decoder.ode_key(len(job.window.codes)), []).append(i)
            elif job.decoder.finished:
                results[i] = Done({"audio": job.header} if job.header else None)   # (no codes: an empty WAV)
        vocoder_in: dict[int, list[tuple[int, Any, tuple[int, int]]]] = {}
        due = sorted(groups.values(), key=lambda members: min(jobs[i].deadline for i in members))
        for members in due[:1]:
            decoded = mels([(jobs[i].decoder, jobs[i].window.start // jobs[i].decoder.block,  # type: ignore[union-attr]
                             jobs[i].window.codes) for i in members])                    # type: ignore[union-attr]
            for i, mel in zip(members, decoded):
                job = jobs[i]
                assert job.window is not None
                mel_in, keep = job.decoder.take_mel(job.window, mel)
                vocoder_in.setdefault(mel_in.shape[2], []).append((i, mel_in, keep))
        for batch in vocoder_in.values():
            pcms = vocode([jobs[i].decoder for i, _, _ in batch], [mel for _, mel, _ in batch])
            for (i, _, keep), pcm in zip(batch, pcms):
                results[i] = jobs[i].chunk(StreamingCode2Wav.cut(pcm, keep))
        return results
