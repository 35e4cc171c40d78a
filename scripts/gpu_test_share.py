"""How many pytest workers share one GPU, and each worker's XLA_PYTHON_CLIENT_MEM_FRACTION.

    read -r workers fraction < <(python3 scripts/gpu_test_share.py)      # gpu_check.sh, gpu_compare.sh

Prints "workers fraction". PYTEST_WORKERS and TEST_MEM_TOTAL (the share of the card all workers split) override the
defaults, which come from the card's memory (nvidia-smi): 8.4 GiB a worker, what 15 workers at 0.9 get on an H200
(140 GiB), where every GPU test passes, and at least 11 GiB left for the workers' CUDA contexts. An H200 gets 15 workers
at 0.9 in all, an H100 (80 GiB) 8 at 0.84: 15 workers at 0.9 on an H100 left no room for their contexts, and every
allocation failed (session 31). Without nvidia-smi: 4 workers at 0.9.
"""

from __future__ import annotations

import os
import subprocess
import sys

GIB_PER_WORKER = 8.4
GIB_FOR_CONTEXTS = 11.0
MAX_WORKERS = 15
MAX_TOTAL = 0.9


def card_gib() -> float:
    """The first GPU's memory in GiB, 0 when nvidia-smi cannot tell."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, check=True, timeout=30).stdout
        return float(out.split()[0]) / 1024
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return 0.0


def share(gib: float, workers: str = "", total: str = "") -> tuple[int, float]:
    """(workers, per-worker memory fraction) for a card of `gib` GiB; non-empty arguments override the defaults."""
    if workers:
        n = int(workers)
    elif gib > 0:
        n = max(1, min(MAX_WORKERS, int((gib - GIB_FOR_CONTEXTS) // GIB_PER_WORKER)))
    else:
        n = 4
    if total:
        t = float(total)
    elif gib > 0:
        t = min(MAX_TOTAL, n * GIB_PER_WORKER / gib)
    else:
        t = MAX_TOTAL
    return n, round(t / n, 3)


def main() -> int:
    n, fraction = share(card_gib(), os.environ.get("PYTEST_WORKERS", ""), os.environ.get("TEST_MEM_TOTAL", ""))
    print(n, fraction)
    return 0


if __name__ == "__main__":
    sys.exit(main())
