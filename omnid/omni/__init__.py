"""Omni speech: the talker and code2wav halves of a Qwen2.5-Omni-shaped model, incrementally.

Runs inside `python` stage workers (their main thread); imports torch and transformers, but only
inside functions and methods, so importing the package stays cheap. transformers' own
`Qwen2_5OmniForConditionalGeneration.generate` runs the thinker to its end, then the talker on the
whole reply, then token2wav on the whole code sequence. Here each runs as its input arrives:

- `talker.TalkerSession`: one job's talker; a prefill from the thinker's prompt rows, then one codec
  token per thinker vector, its KV cache kept across windows (never re-running the prefix);
- `code2wav.StreamingCode2Wav`: one job's token2wav; codec tokens in, PCM out, block by block with
  the context the DiT's block attention was built for, and an overlap for BigVGAN.
"""
