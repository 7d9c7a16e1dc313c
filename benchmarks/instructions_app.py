"""The benchmark app (``benchmarks.bench_app``) with one task more, for
``benchmarks/instructions.py``: it zeroes or dumps callgrind's counters from inside the pool
process, which ``callgrind_control`` cannot reach (valgrind's gdbserver does not follow a
fork). The task calls callgrind's client requests through a small library the benchmark
compiles (``SAGA_CALLGRIND_LIB``), and answers with its process id on a Redis list."""

from __future__ import annotations

import ctypes
import os

from benchmarks.bench_app import _redis, app

__all__ = ["ANSWER_PREFIX", "app", "callgrind"]

#: The task pushes its process id to ``ANSWER_PREFIX + token``; the benchmark BLPOPs it.
ANSWER_PREFIX = "bench:callgrind:"
_library: ctypes.CDLL | None = None


@app.task(name="bench.callgrind", ignore_result=True, shared=False)
def callgrind(action: str, token: str) -> None:
    """``action``: ``zero`` or ``dump``."""
    global _library
    if _library is None:
        _library = ctypes.CDLL(os.environ["SAGA_CALLGRIND_LIB"])
    getattr(_library, f"saga_callgrind_{action}")()
    _redis().lpush(ANSWER_PREFIX + token, os.getpid())
