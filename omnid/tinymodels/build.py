"""How every tiny model is built: offline (the Hugging Face switches set before any library is
imported), seeded, into a temporary sibling folder moved into place once complete, with the marker
(``.omnid-tiny-ok``) that ``is_built`` reads.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

MARKER_NAME = ".omnid-tiny-ok"
FORMAT_VERSION = 3          # 2: the LLM's tokenizer has a chat template (LLM_CHAT_TEMPLATE); 3: a multimodal
                            # model's tokenizer takes as many tokens as its LM (the ALM's 30 s clip: 750)
SEED = 1234


def offline_env() -> None:
    """Make sure no library tries to reach the Hugging Face hub."""
    for key in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE"):
        os.environ.setdefault(key, "1")
    os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
    os.environ.setdefault("DIFFUSERS_NO_ADVISORY_WARNINGS", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def quiet_env() -> None:
    """Silence progress bars and import-time warnings (command line only)."""
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("DIFFUSERS_VERBOSITY", "error")


def seed_all(seed: int) -> None:
    """Seed Python, NumPy and torch random generators."""
    import random

    import numpy as np
    import torch

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def _marker(kind: str) -> dict[str, Any]:
    """Return the marker content that a complete build of `kind` carries."""
    return {"kind": kind, "format": FORMAT_VERSION}


def is_built(model_dir: Path, kind: str) -> bool:
    """Tell whether `model_dir` holds a complete, current build of `kind`."""
    marker = Path(model_dir) / MARKER_NAME
    try:
        data = json.loads(marker.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(data, dict) and all(data.get(k) == v for k, v in _marker(kind).items())


def _apply_umask(folder: Path) -> None:
    """Give `folder` and everything in it ordinary permissions (mkdtemp makes 0700)."""
    umask = os.umask(0)
    os.umask(umask)
    folder.chmod(0o777 & ~umask)
    for path in folder.rglob("*"):
        path.chmod((0o777 if path.is_dir() else 0o666) & ~umask)


def build_atomically(model_dir: Path, kind: str, fill: Callable[[Path], None]) -> Path:
    """Run `fill` on a temporary sibling folder, then move it to `model_dir`.

    The marker file is written last, so a crash leaves no marker behind and
    never a half-written `model_dir`.
    """
    model_dir = Path(model_dir).absolute()
    model_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{model_dir.name}.tmp-", dir=model_dir.parent))
    try:
        fill(tmp)
        (tmp / MARKER_NAME).write_text(json.dumps(_marker(kind)) + "\n", encoding="utf-8")
        _apply_umask(tmp)
        if model_dir.exists():
            shutil.rmtree(model_dir)
        tmp.rename(model_dir)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return model_dir
