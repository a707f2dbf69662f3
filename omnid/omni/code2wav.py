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

BigVGAN is convolutional: each block's mel is vocoded with `overlap_frames` of mel on both sides
(the left side from the blocks already final, the right side from this window's lookahead) and the
samples of the block alone are kept.
"""

from __future__ import annotations

from typing import Any

SAMPLES_PER_FRAME = 240         # BigVGAN's upsampling (5*3*2*2*2*2)
SAMPLE_RATE = 24000


class StreamingCode2Wav:
    """Codes in (`push`), PCM (float32 in [-1, 1], 24 kHz) out, a block at a time."""

    def __init__(self, token2wav: Any, speaker: dict[str, Any], *, num_steps: int = 10,
                 guidance_scale: float = 0.5, sway_coefficient: float = -1.0, chunk_blocks: int = 1,
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
        self.chunk_blocks = max(1, chunk_blocks)
        self.context_blocks = max(0, context_blocks)
        self.lookahead_blocks = max(0, lookahead_blocks)
        self.overlap = max(0, overlap_frames)
        self.seed = seed
        self.codes: list[int] = []
        self._noise: list[Any] = []                            # per block, (block, mel_dim)
        self._mel: Any = torch.zeros(1, self.dit.mel_dim, 0, device=self.device, dtype=self.dtype)  # final
        self._done_blocks = 0                                  # blocks whose audio went out
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
        torch = self._torch
        from transformers.models.qwen2_5_omni.modeling_qwen2_5_omni import RungeKutta4ODESolver

        code = torch.tensor([codes], dtype=torch.long, device=self.device)
        frames = self._frames(len(codes))
        cond = self.cond.unsqueeze(1).repeat(1, frames, 1)

        def velocity(t: Any, x: Any) -> Any:
            if self.guidance_scale < 1e-5:
                return self.dit(hidden_states=x, speaker_embedding=cond, condition_vector=self.ref_mel,
                                quantized_code=code, time_step=t, drop_audio_conditioning=False, drop_code=False,
                                apply_cfg=False)
            out = self.dit(hidden_states=x, quantized_code=code, speaker_embedding=cond,
                           condition_vector=self.ref_mel, time_step=t, apply_cfg=True)
            guided, null = torch.chunk(out, 2, dim=0)
            return guided + (guided - null) * self.guidance_scale

        t = torch.linspace(0, 1, self.num_steps, device=self.device, dtype=self.dtype)
        if self.sway is not None:
            t = t + self.sway * (torch.cos(torch.pi / 2 * t) - 1 + t)
        with torch.no_grad():
            x = RungeKutta4ODESolver(function=velocity, initial_value=self._noise_for(first_block, frames)) \
                .integrate(t)[-1]
        return x.permute(0, 2, 1)

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

    def _available_blocks(self) -> int:
        frames = self._frames(len(self.codes))
        return -(-frames // self.block) if self.finished else frames // self.block

    def _drain(self) -> list[Any]:
        out = []
        while True:
            have = self._available_blocks()
            first = self._done_blocks
            if first >= have:
                break
            last = min(first + self.chunk_blocks, have)
            if not self.finished and last + self.lookahead_blocks > have:
                break
            out.append(self._decode(first, last, min(have, last + self.lookahead_blocks)))
            self._done_blocks = last
        return out

    def _decode(self, first: int, last: int, window_end: int) -> Any:
        """Decode blocks [first, last) in the window [first - context, window_end); return their PCM."""
        torch = self._torch
        start = max(0, first - self.context_blocks)
        codes_per_block = self.block // self.repeats
        window_codes = self.codes[start * codes_per_block:window_end * codes_per_block]
        mel = self._mel_of(start, window_codes)
        lo = (first - start) * self.block
        hi = min(mel.shape[2], (last - start) * self.block)
        chunk = mel[:, :, lo:hi]
        left = self._mel[:, :, max(0, self._mel.shape[2] - self.overlap):]
        right = mel[:, :, hi:hi + self.overlap]
        self._mel = torch.cat([self._mel, chunk], dim=2)
        pcm = self._vocode(torch.cat([left, chunk, right], dim=2))
        a = left.shape[2] * SAMPLES_PER_FRAME
        return pcm[a:a + chunk.shape[2] * SAMPLES_PER_FRAME]

    # -- the reference -----------------------------------------------------------------------------

    def decode_whole(self, codes: list[int]) -> Any:
        """The whole sequence at once, from the same per-block noise: what the seams are measured
        against (and, with the same noise, what transformers' token2wav computes)."""
        return self._vocode(self._mel_of(0, [int(c) for c in codes]))
