"""Writing a job's final outputs into its folder, from inside a sink stage's worker.

Runs in the worker's main thread; blocks on disk writes. Each value becomes
one file, named after the output, written atomically (temp file + rename), and
private (omnid.paths: 0600 files in 0700 folders, whatever the umask):

  str                      -> NAME.txt   text/plain       kind "text"
  PIL image                -> NAME.png   image/png        kind "image"
  list of PIL images       -> NAME-K.png image/png        kind "image"
  bytes (PNG / WAV / other)-> NAME.png / NAME.wav / NAME.bin
  torch tensor, ndarray    -> NAME.npy   application/x-npy kind "tensor" (bfloat16 as float32)
  dict, list, number, bool -> NAME.json  application/json kind "json"
"""

from __future__ import annotations

import io
import json
import re
import shutil
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, BinaryIO

from omnid.config import PipelineConfig
from omnid.job_files import PlannedFile, private, private_dirs, write_planned
from omnid.paths import STREAM_DIR, stream_file
from omnid.protocol import Output


def _is_pil(value: Any) -> bool:
    return hasattr(value, "save") and hasattr(value, "mode") and hasattr(value, "size")


def _png(image: Any) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def _sniff(data: bytes) -> tuple[str, str, str]:
    if data.startswith(b"\x89PNG\r\n\x1a\n"):
        return "png", "image/png", "image"
    if data[:4] == b"RIFF" and data[8:12] == b"WAVE":
        return "wav", "audio/wav", "audio"
    if data[:3] == b"ID3" or data[:2] == b"\xff\xfb":
        return "mp3", "audio/mpeg", "audio"
    if data[:3] == b"\xff\xd8\xff":
        return "jpg", "image/jpeg", "image"
    return "bin", "application/octet-stream", "file"


def encode_value(value: Any) -> Iterator[tuple[str, bytes, str, str]]:
    """(suffix, bytes, content type, kind) for each file one output value becomes."""
    if isinstance(value, str):
        yield "txt", value.encode("utf-8"), "text/plain; charset=utf-8", "text"
    elif isinstance(value, (bytes, bytearray, memoryview)):
        data = bytes(value)
        ext, ctype, kind = _sniff(data)
        yield ext, data, ctype, kind
    elif _is_pil(value):
        yield "png", _png(value), "image/png", "image"
    elif isinstance(value, (list, tuple)) and value and all(_is_pil(v) for v in value):
        for i, img in enumerate(value):
            yield f"{i}.png", _png(img), "image/png", "image"
    elif hasattr(value, "detach") and hasattr(value, "cpu"):          # a torch tensor
        tensor = value.detach().cpu()
        if tensor.is_floating_point() and tensor.element_size() < 4 and str(tensor.dtype) != "torch.float16":
            tensor = tensor.float()                 # bfloat16 (float8): no numpy dtype; float32 holds it exactly
        yield from encode_value(tensor.numpy())
    elif type(value).__module__ == "numpy" and hasattr(value, "dtype"):
        import numpy as np
        buf = io.BytesIO()
        np.save(buf, value, allow_pickle=False)
        yield "npy", buf.getvalue(), "application/x-npy", "tensor"
    else:
        try:
            text = json.dumps(value, default=str, allow_nan=False)
        except ValueError:                          # NaN or Infinity: not JSON; keep the Python text
            text = json.dumps(repr(value))
        yield "json", text.encode(), "application/json", "json"


def _file_stem(name: str, taken: set[str]) -> str:
    """A file name for an output name that stays inside the job's folder.

    Output names may come from a job's inputs (a stage that passes its inputs on), so
    they are never trusted as paths: no separators, no leading dot, nothing but
    [A-Za-z0-9_.-]; a clash with an earlier output gets a numeric suffix.
    """
    stem = re.sub(r"[^A-Za-z0-9_.-]", "_", name).lstrip(".")[:100] or "output"
    candidate, n = stem, 1
    while candidate in taken:
        n += 1
        candidate = f"{stem}_{n}"
    taken.add(candidate)
    return candidate


def clear_stream(job_dir: Path, prefix: str = "") -> None:
    """Remove a last stage's stream files of a job (all of them, or those of its `prefix` when the
    pipeline has several last stages); readers that have one open keep reading it."""
    folder = job_dir / STREAM_DIR
    if not prefix:
        shutil.rmtree(folder, ignore_errors=True)
        return
    start = stream_file(job_dir, prefix).name
    for path in folder.glob("*"):
        if path.name.startswith(start):
            path.unlink(missing_ok=True)


class StreamWriter:
    """A last stage's live outputs for one job: each segment's text and bytes values appended to
    their stream files (read with `?stream=1`). The files stay open while the job runs and are
    flushed once per engine step (`flush`), not opened, written and closed for every token."""

    def __init__(self, job_dir: Path, prefix: str = "") -> None:
        self.job_dir = job_dir
        self.prefix = prefix
        self._files: dict[str, BinaryIO] = {}

    def append(self, segment: Mapping[str, Any]) -> None:
        for name, value in segment.items():
            if isinstance(value, str):
                data = value.encode("utf-8")
            elif isinstance(value, (bytes, bytearray, memoryview)):
                data = bytes(value)
            else:
                continue
            f = self._files.get(name)
            if f is None:
                path = stream_file(self.job_dir, f"{self.prefix}{name}")
                private_dirs(path.parent)
                f = self._files[name] = open(path, "ab", opener=private)
            f.write(data)

    def flush(self) -> None:
        for f in self._files.values():
            f.flush()

    def close(self) -> None:
        for f in self._files.values():
            f.close()
        self._files.clear()


def write_outputs(job: str, job_dir: Path, outputs: Mapping[str, Any], prefix: str = "") -> list[Output]:
    """Write every output of a sink stage; return one `Output` event per file."""
    return write_planned(job, job_dir, plan_outputs(outputs, prefix))


def plan_outputs(outputs: Mapping[str, Any], prefix: str = "") -> list[PlannedFile]:
    """Each output value encoded into its file(s), named, but not written (a Ray-placed sink encodes
    here, on its node, and the supervisor writes them into the job's folder: `write_planned`)."""
    planned: list[PlannedFile] = []
    taken: set[str] = {"manifest"}        # the scheduler writes manifest.json beside the outputs
    for name, value in outputs.items():
        base = f"{prefix}{name}"
        stem = _file_stem(str(base), taken)
        for suffix, data, ctype, kind in encode_value(value):
            if "." in suffix:                      # one of several images: name-K.png
                index, ext = suffix.split(".", 1)
                out_name, file = f"{base}-{index}", f"{stem}-{index}.{ext}"
            else:
                out_name, file = base, f"{stem}.{suffix}"
            planned.append((out_name, file, data, ctype, kind))
    return planned


# A sink's outputs -> their files in the job's folder, one `Output` event each (job, outputs, prefix).
WriteOutputs = Callable[[str, dict[str, Any], str], list[Output]]


class Sink:
    """One stage's part of its jobs' folders, in the pipelines where it is a last stage (or keeps
    outputs): its outputs' files when a request ends (`write`, by `write_files`: into the folder
    here, or a Ray-placed worker's through the supervisor), and its segments' stream files while
    it runs (`open_live`, where `live`: the folder is on this machine). Main thread only."""

    def __init__(self, stage: str, jobs_dir: Path, write_files: WriteOutputs | None, live: bool) -> None:
        self.stage = stage
        self.jobs_dir = jobs_dir
        self.write_files: WriteOutputs = write_files or self._write_here
        self.live = live

    def is_for(self, pipeline: PipelineConfig) -> bool:
        return self.stage in pipeline.sinks

    def prefix(self, pipeline: PipelineConfig) -> str:
        """How this last stage's outputs are named apart from the other last stages' ones."""
        return f"{self.stage}." if len(pipeline.sinks) > 1 else ""

    def open_live(self, job: str, pipeline: PipelineConfig) -> StreamWriter | None:
        """A request starts: its stream files (those of an earlier attempt, before a retry, cleared)."""
        if not self.is_for(pipeline) or not self.live:
            return None
        clear_stream(self.jobs_dir / job, self.prefix(pipeline))
        return StreamWriter(self.jobs_dir / job, self.prefix(pipeline))

    def close_live(self, job: str, pipeline: PipelineConfig, writer: StreamWriter | None) -> None:
        """A request ended. Its segments were streamed to files for `?stream=1` readers (who keep
        their open file); from now on the job's outputs are its final files."""
        if writer is not None:
            writer.close()
        if self.is_for(pipeline) and self.live:
            clear_stream(self.jobs_dir / job, self.prefix(pipeline))

    def write(self, job: str, pipeline: PipelineConfig, outputs: Mapping[str, Any]) -> list[Output]:
        """The request's outputs that are the job's, as files; one `Output` event each."""
        return self.write_files(job, pipeline.kept(self.stage, outputs), self.prefix(pipeline))

    def _write_here(self, job: str, outputs: Mapping[str, Any], prefix: str) -> list[Output]:
        return write_outputs(job, self.jobs_dir / job, outputs, prefix)
