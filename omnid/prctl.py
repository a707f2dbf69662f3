"""What a process of omnid's asks of the kernel about itself (prctl): to die with its parent, and
the name `ps` shows.

Used by a stage worker (a local one: `omnid.worker.bootstrap`) and by its vLLM engine core process
(`omnid.engines.vllm_engine`), each first thing in the process. Standard library only; nothing here
blocks.
"""

from __future__ import annotations

import ctypes
import os
import signal

from omnid.protocol import EXIT_ORPHANED

_PR_SET_PDEATHSIG = 1
_PR_SET_NAME = 15


def die_with_parent(parent_pid: int) -> None:
    """Ask the kernel to SIGKILL us when our parent dies (even by SIGKILL): a worker's supervisor, an
    engine core's worker."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent_pid:   # the parent died before prctl took effect
        os._exit(EXIT_ORPHANED)


def set_process_name(name: str) -> None:
    """The name `ps -o comm`, `top` and `pgrep omnid` show (15 bytes at most)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_NAME, ctypes.c_char_p(name.encode()[:15]), 0, 0, 0)
    except (OSError, AttributeError):
        pass
