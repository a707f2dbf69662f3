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
(the DiT's ODE steps, 10), `guidance_scale` (0.5), `context_blocks` (2), `lookahead_blocks` (1),
`chunk_blocks` (1), `seed` (0), `code_offset` (0: the id of code 0 among its input's ids; a codec
LM's `token_ids` start after its text tokens, e.g. the tiny `tts` model's `codec_offset`, 1000).
"""

from __future__ import annotations

import struct
import threading
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from omnid.omni.code2wav import SAMPLE_RATE, StreamingCode2Wav
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


def _speaker(speakers: dict[str, Any], params: dict[str, Any]) -> dict[str, Any]:
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


def talker(inputs: dict[str, Any], params: dict[str, Any], ctx: Any) -> Iterator[dict[str, Any] | None]:
    import torch

    for key in ("prompt_ids", "ids", "states"):
        if key not in inputs:
            raise ValueError(f"the talker needs input {key!r} (map prompt_ids = \"prompt_token_ids\", "
                             "ids = \"token_ids\", states = \"hidden_states\" on its edge from the thinker)")
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
    if per_token is not None:
        session.max_codes = min(session.max_codes, max(1, int(float(per_token) * len(ids))))
    yield from codes_now()


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


def code2wav(inputs: dict[str, Any], params: dict[str, Any], ctx: Any) -> Iterator[dict[str, Any] | None]:
    if "codes" not in inputs:
        raise ValueError("code2wav needs input 'codes' (the talker's codec tokens)")
    model, speakers = _cached("token2wav", _model_dir(ctx))
    decoder = StreamingCode2Wav(
        model, _speaker(speakers, params), num_steps=int(params.get("num_steps", 10)),
        guidance_scale=float(params.get("guidance_scale", 0.5)), chunk_blocks=int(params.get("chunk_blocks", 1)),
        context_blocks=int(params.get("context_blocks", 2)), lookahead_blocks=int(params.get("lookahead_blocks", 1)),
        seed=int(params.get("seed", 0)))
    offset = int(params.get("code_offset", 0))
    n_codes = int(model.code2wav_dit_model.config.num_embeds)
    header = wav_header()
    for window in _windows(inputs["codes"]):
        codes = [c - offset for c in _flat(window)]
        bad = [c + offset for c in codes if not 0 <= c < n_codes]
        if bad:
            raise ValueError(f"codes {bad[:5]} are not codec codes: with code_offset {offset} they must be in "
                             f"[{offset}, {offset + n_codes})")
        chunks = decoder.push(codes)
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
