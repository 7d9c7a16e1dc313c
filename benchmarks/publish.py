"""The caller's CPU per run for each way a step's message is sent, alternated in one process.

Starts a private redis-server and a worker (``benchmarks.bench_app``), then drives saga runs
(``benchmarks.steps.drive_saga``, one at a time) in blocks, each block sending every step's
message one way, the three ways taking turns block after block so that the machine's drift
hits them alike:

- ``celery``: Celery's own ``send_task`` (the prepared publish turned off);
- ``apart``: the message prepared once per task (``saga.prepared_publish``), pushed with its
  own ``LPUSH`` after the reservation;
- ``reservation``: the same message pushed by the step's reservation, in its script.

Prints, per way, the median of the blocks' caller CPU ms per run, and each block's figure.
Between two invocations on a shared machine the absolute figures move; the ratios between the
ways, measured in one invocation, are what it is for (``docs/performance.md``, round three).

    python benchmarks/publish.py --blocks 6 --runs 100 [--fail]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks import costs  # noqa: E402

WAYS = ("celery", "apart", "reservation")


def send_one_way(core: Any, way: str) -> None:
    """Make ``core`` send each step's message ``way``."""
    if way == "reservation":
        core.__dict__.pop("_push_with_reservation", None)
    else:
        core._push_with_reservation = lambda *args: None
    core.prepared._same_redis = way != "celery"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--blocks", type=int, default=6, help="blocks per way")
    parser.add_argument("--runs", type=int, default=100, help="runs per block")
    parser.add_argument("--fail", action="store_true", help="the failing path (two undos)")
    args = parser.parse_args(argv)
    from saga.testing import RedisServer, WorkerProcess

    server = RedisServer("--appendonly", "no").start()
    env = costs.bench_environment(server.url, "saga-publish-")
    tmp = Path(env["SAGA_DEMO_DATA"]).parent
    worker = WorkerProcess("benchmarks.bench_app", env=env, cwd=ROOT, logfile=tmp / "worker.log")
    figures: dict[str, list[float]] = {way: [] for way in WAYS}
    try:
        worker.start()
        from benchmarks import bench_app, steps

        core = bench_app.saga.core
        if not core.prepared._same_redis:
            raise SystemExit("the broker is not the store's Redis: nothing to compare")
        for i in range(30):  # warm-up: every script loaded, every task's message prepared
            steps.drive_saga(bench_app.saga, i, args.fail, 30)
        for _ in range(args.blocks):
            for way in WAYS:
                send_one_way(core, way)
                started = time.process_time()
                for i in range(args.runs):
                    steps.drive_saga(bench_app.saga, i, args.fail, 30)
                figures[way].append((time.process_time() - started) / args.runs * 1000)
    finally:
        worker.stop()
        server.stop()
    path = "failing" if args.fail else "happy"
    print(f"caller CPU ms per {path} run, {args.blocks} blocks of {args.runs} runs per way")
    for way, values in figures.items():
        blocks = " ".join(f"{v:.2f}" for v in values)
        print(f"  {way:12s} median {statistics.median(values):.2f}   blocks {blocks}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
