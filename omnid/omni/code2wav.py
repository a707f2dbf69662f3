"""One job's Qwen2.5-Omni token2wav, decoding codec tokens into PCM as they arrive.

Runs in a stage worker's main thread (a `python` stage); blocks only on its own forward passes.

transformers decodes a whole code sequence at once: the DiT integrates an ODE from noise to a mel
spectrogram (each code is `repeats` = 2 mel frames), then BigVGAN turns the mel into 24 kHz audio
(240 samples a frame, 480 a code). Here the sequence is decoded in blocks, as the DiT was built for:
its attention is block-wise (`block_size` frames, 24 in Qwen2.5-Omni; a layer sees its own block,
one block back, or one ahead), so a block is decoded in a window of `context_blocks` before it and
`lookahead_blocks` after it, aligned to the whole sequence's block grid (the block index is the
frame index // block_size within the window, so a window must start on a block boundary). Rope is
relative, the speaker conditioning global, and the noise a block starts from is drawn per block
from the job's seed: the same frame starts from the same noise in every window it is in, and in a
whole-sequence decode (`decode_whole`) too, which is what the seams are measured against.

The windows ramp up (`StreamingCode2Wav`): the first makes a few codes final with only the
vocoder's overlap as look-ahead, so that the first audio comes early; the later ones make more at
once, sharing their context and look-ahead. Only a window's start is on the block grid: the frames
it makes final may begin and end inside a block.

Each DiT call of a window's ODE reuses what does not change between the solver's calls
(`_Velocity`): the speaker encoder on the reference mel, the code embeddings, the rope, the mask.

BigVGAN is convolutional: each window's mel is vocoded with `overlap_frames` of mel on both sides
(the left side from the frames already final, the right side from this window's lookahead) and the
samples of its final frames alone are kept.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

SAMPLES_PER_FRAME = 240         # BigVGAN's upsampling (5*3*2*2*2*2)
SAMPLE_RATE = 24000


DEFAULT_RAMP = (6, 12, 24, 48)   # codes made final by the 1st, 2nd, 3rd window, then by each
FIRST_LOOKAHEAD_CODES = 4       # the first window's look-ahead: the vocoder's right overlap (8 frames)


@dataclass(frozen=True)
class Window:
    """One decode of a job's stream, in mel frames: frames [first, last) made final, decoded in the
    window of frames [start, end) (`start` on the block grid; `codes` the window's codes)."""

    start: int
    first: int
    last: int
    end: int
    codes: list[int]


class StreamingCode2Wav:
    """Codes in (`push`), PCM (float32 in [-1, 1], 24 kHz) out, a window at a time.

    The windows ramp up (`ramp`, in codes, the last size repeating): the first makes only a few
    codes final, with just the vocoder's overlap as its look-ahead, so that the first audio needs
    few codes; the later ones make more final at once, sharing one window's context and look-ahead
    (less DiT work a block: 180 frames decoded for 96 made final at (6, 12, 24, 48) with 2 blocks of
    context and 1 of look-ahead, where one block a window decodes 96 for 24). `chunk_blocks` instead
    gives the fixed windows of that many blocks, each with `lookahead_blocks` of look-ahead."""

    def __init__(self, token2wav: Any, speaker: Mapping[str, Any], *, num_steps: int = 10,
                 guidance_scale: float = 0.5, sway_coefficient: float = -1.0, chunk_blocks: int | None = None,
                 ramp: tuple[int, ...] | list[int] | None = None, first_lookahead_codes: int | None = None,
                 context_blocks: int = 2, lookahead_blocks: int = 1, overlap_frames: int = 8, seed: int = 0) -> None:
        import torch

        self._torch = torch
        self.dit = token2wav.code2wav_dit_model
        self.vocoder = token2wav.code2wav_bigvgan_model
        self.device = self.dit.proj_out.weight.device
        self.dtype = self.dit.proj_out.weight.dtype
        self.cond = speaker["cond"].to(self.device, self.dtype)
        self.ref_mel = speaker["ref_mel"].to(self.device, self.dtype)
        self.repeats = int(self.dit.repeats)
        self.block = int(self.dit.block_size)                 # frames
        self.num_steps = num_steps
        self.guidance_scale = guidance_scale
        self.sway = sway_coefficient
        self.context_blocks = max(0, context_blocks)
        self.lookahead_blocks = max(0, lookahead_blocks)
        codes_per_block = self.block // self.repeats
        if chunk_blocks is not None and ramp is None:
            self.ramp: tuple[int, ...] = (max(1, chunk_blocks) * codes_per_block,)
            first_look = self.lookahead_blocks * codes_per_block
        else:
            self.ramp = tuple(max(1, int(c)) for c in (ramp or DEFAULT_RAMP))
            first_look = FIRST_LOOKAHEAD_CODES
        self.first_lookahead = self._frames(first_look if first_lookahead_codes is None else max(0, first_lookahead_codes))
        self.overlap = max(0, overlap_frames)
        self.seed = seed
        self.codes: list[int] = []
        self._noise: list[Any] = []                            # per block, (block, mel_dim)
        self._mel: Any = torch.zeros(1, self.dit.mel_dim, 0, device=self.device, dtype=self.dtype)  # final
        self._done = 0                                         # frames whose audio went out
        self._windows = 0                                      # windows decoded
        self.finished = False

    # -- the pieces ------------------------------------------------------------------------------

    def _frames(self, codes: int) -> int:
        return codes * self.repeats

    def _noise_for(self, first_block: int, frames: int) -> Any:
        torch = self._torch
        last = first_block + -(-frames // self.block)
        while len(self._noise) < last:
            g = torch.Generator(device="cpu").manual_seed(self.seed * 1_000_003 + len(self._noise))
            self._noise.append(torch.randn(self.block, self.dit.mel_dim, generator=g))
        noise = torch.cat(self._noise[first_block:last])[:frames]
        return noise[None].to(self.device, self.dtype)

    def _mel_of(self, first_block: int, codes: list[int]) -> Any:
        """The DiT's mel (1, mel_dim, frames) for `codes`, starting at block `first_block`."""
        return mels([(self, first_block, codes)])[0]

    def ode_key(self, codes: int) -> tuple[Any, ...]:
        """What decodes of several jobs must share to run as one batch: the frame count, the ODE and
        guidance settings, and the reference mel's shape (the rows of a batch never mix)."""
        return (self._frames(codes), self.num_steps, self.guidance_scale, self.sway, tuple(self.ref_mel.shape),
                id(self.dit))

    def _vocode(self, mel: Any) -> Any:
        with self._torch.no_grad():
            return self.vocoder(mel).reshape(-1).float()

    # -- streaming -------------------------------------------------------------------------------

    def push(self, codes: list[int]) -> list[Any]:
        """Add codes; return the PCM chunks (1-D float32 tensors) that are now final."""
        self.codes.extend(int(c) for c in codes)
        return self._drain()

    def finish(self) -> list[Any]:
        """No more codes: decode the rest."""
        self.finished = True
        return self._drain()

    def _drain(self) -> list[Any]:
        out = []
        while (window := self.next_window()) is not None:
            vocoder_in, keep = self.take_mel(window, self._mel_of(window.start // self.block, window.codes))
            out.append(self.cut(self._vocode(vocoder_in), keep))
        return out

    def next_window(self) -> Window | None:
        """The next decode whose codes are all here (with its look-ahead), or None."""
        have = self._frames(len(self.codes))
        first = self._done
        if first >= have:
            return None
        last = min(first + self._frames(self.ramp[min(self._windows, len(self.ramp) - 1)]), have)
        look = self.first_lookahead if self._windows == 0 else self.lookahead_blocks * self.block
        if not self.finished and last + look > have:
            return None
        if self.finished and self._windows > 0 and have - last <= self._frames(self.ramp[-1]) // 4:
            last = have                         # (a last scrap joins this window: one window less)
        end = min(have, last + look)
        start = max(0, (first // self.block - self.context_blocks) * self.block)
        return Window(start, first, last, end, self.codes[start // self.repeats:-(-end // self.repeats)])

    def take_mel(self, window: Window, mel: Any) -> tuple[Any, tuple[int, int]]:
        """The window's mel (1, mel_dim, frames) decoded: its blocks made final; returns the
        vocoder's input (the final blocks with `overlap` frames of mel on both sides) and which of
        its samples are the blocks' (`cut`)."""
        torch = self._torch
        lo = window.first - window.start
        hi = min(mel.shape[2], window.last - window.start)
        chunk = mel[:, :, lo:hi]
        left = self._mel[:, :, max(0, self._mel.shape[2] - self.overlap):]
        right = mel[:, :, hi:hi + self.overlap]
        self._mel = torch.cat([self._mel, chunk], dim=2)
        self._done = window.last
        self._windows += 1
        return torch.cat([left, chunk, right], dim=2), (left.shape[2] * SAMPLES_PER_FRAME,
                                                        chunk.shape[2] * SAMPLES_PER_FRAME)

    @staticmethod
    def cut(pcm: Any, keep: tuple[int, int]) -> Any:
        return pcm[keep[0]:keep[0] + keep[1]]

    # -- the reference -----------------------------------------------------------------------------

    def decode_whole(self, codes: list[int]) -> Any:
        """The whole sequence at once, from the same per-block noise: what the seams are measured
        against (and, with the same noise, what transformers' token2wav computes)."""
        return self._vocode(self._mel_of(0, [int(c) for c in codes]))


def mels(decodes: list[tuple[StreamingCode2Wav, int, list[int]]]) -> list[Any]:
    """The DiT's mel (1, mel_dim, frames) of each (decoder, first block, codes), as one batched ODE
    for decodes with the same `ode_key` (the caller groups them): one forward a solver step for all.
    Each row starts from its own job's noise, with its own speaker and codes."""
    import torch
    from transformers.models.qwen2_5_omni.modeling_qwen2_5_omni import RungeKutta4ODESolver

    lead = decodes[0][0]
    assert all(d.ode_key(len(c)) == lead.ode_key(len(decodes[0][2])) for d, _, c in decodes)
    frames = lead._frames(len(decodes[0][2]))
    code = torch.tensor([c for _, _, c in decodes], dtype=torch.long, device=lead.device)
    cond = torch.cat([d.cond.unsqueeze(1).repeat(1, frames, 1) for d, _, _ in decodes])
    ref_mel = torch.cat([d.ref_mel for d, _, _ in decodes])
    noise = torch.cat([d._noise_for(first, frames) for d, first, _ in decodes])
    with torch.no_grad():
        velocity = _Velocity(lead.dit, cond, ref_mel, code, lead.guidance_scale)
    t = torch.linspace(0, 1, lead.num_steps, device=lead.device, dtype=lead.dtype)
    if lead.sway is not None:
        t = t + lead.sway * (torch.cos(torch.pi / 2 * t) - 1 + t)
    with torch.no_grad():
        x = RungeKutta4ODESolver(function=velocity, initial_value=noise).integrate(t)[-1]
    return [row[None].permute(0, 2, 1) for row in x]


class _Velocity:
    """The DiT's forward as the ODE calls it (`Qwen2_5OmniToken2WavDiTModel.forward`, with or
    without guidance), its parts that do not change between the solver's calls computed once a
    window: the speaker encoder on the reference mel, the code embeddings, their concatenation, the
    rotary embedding and the block mask. The same modules in the same order, so the same numbers:
    only the repeats are gone (a tiny DiT's call was a third speaker encoder)."""

    def __init__(self, dit: Any, cond: Any, ref_mel: Any, code: Any, guidance: float) -> None:
        import torch

        self.dit = dit
        self.guided = guidance >= 1e-5
        self.guidance = guidance
        frames = cond.shape[1]
        embed = dit.input_embed
        code_embed = dit.text_embed(code, drop_code=False)
        if self.guided:                         # (input_embed with apply_cfg: the rows, then their null)
            code_embed = torch.cat([code_embed, dit.text_embed(code, drop_code=True)])
            cond = torch.cat([cond, torch.zeros_like(cond)])
            ref_mel = torch.cat([ref_mel, torch.zeros_like(ref_mel)])
        condition = embed.spk_encoder(ref_mel).unsqueeze(1).repeat(1, frames, 1)
        self.rest = torch.cat((condition, code_embed, cond), dim=-1)
        rows = self.rest.shape[0]
        positions = torch.arange(frames, device=cond.device)[None, :].repeat(rows, 1)
        self.position_embeddings = dit.rotary_embed(self.rest, positions)
        self.block_diff = dit._create_block_diff(self.rest[:, :, :1].expand(rows, frames, 1))

    def __call__(self, t: Any, x: Any) -> Any:
        import torch

        dit = self.dit
        hidden = torch.cat([x, x], dim=0) if self.guided else x
        time_embedding = dit.time_embed(t.repeat(hidden.shape[0]) if t.ndim == 0 else t)
        hidden = dit.input_embed.proj(torch.cat((hidden, self.rest), dim=-1))
        for block in dit.transformer_blocks:
            hidden = block(hidden, time_embedding, position_embeddings=self.position_embeddings,
                           block_diff=self.block_diff)
        out = dit.proj_out(dit.norm_out(hidden, time_embedding))
        if not self.guided:
            return out
        guided, null = torch.chunk(out, 2, dim=0)
        return guided + (guided - null) * self.guidance


def vocode(decoders: list[StreamingCode2Wav], inputs: list[Any]) -> list[Any]:
    """BigVGAN on several mels (1, mel_dim, frames) of the same length, as one batch: 1-D float32 PCM each."""
    import torch

    with torch.no_grad():
        out = decoders[0].vocoder(torch.cat(inputs))       # (it squeezes: a batch of one is 1-D)
    return [row.float() for row in out.reshape(len(inputs), -1)]
