"""A cut of the failing path measured where it is, for failing saga runs: the code as it is
and, alternated in blocks (which goes first alternating too), the way before the cut
(``benchmarks.failures_app``). ``--cut traceback`` (round six): a tool's failure raised from
the tool's own frames, against saga's delivery frames above them. ``--cut chain`` (round
seven): the unwind's chain prepared, pushed by its mark's script and passed on by the script
recording each newer undo done, against Celery's publish with the mark apart and Celery's
tracer passing it on. ``--cut failure`` (round eight): the unwind's chain made before the
final failure's record and pushed by it, against the record read back and the mark apart.
``--cut conclusion`` (round eight): the run concluded by the last undo's record, judged on the
reading just before, against the record read back and the conclusion apart.
One Redis of its own (``--durable``: syncing every write); each block is a prefork worker of
its own (concurrency 2) and runs driven 8 at a time.

Prints, per way, the medians over the blocks of the runs/s and of the CPU ms per run of
Celery's ``TraceInfo.handle_failure``, of ``Core.start_unwind`` and of the failed step's
``saga.forward._record_failure`` (the record and the unwind's start) in the pool children, of
the pool children and of the worker's main process.

    python benchmarks/failures.py [--cut traceback|chain|failure|conclusion] [--durable]
        [--blocks 3] [--runs 200]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks import costs  # noqa: E402

#: Per cut, its two ways: the environment each block's worker gets.
CUTS = {
    "traceback": {
        "own frames": {"SAGA_BENCH_WHOLE_TRACEBACKS": "0"},
        "whole": {"SAGA_BENCH_WHOLE_TRACEBACKS": "1"},
    },
    "chain": {
        "pushed": {"SAGA_BENCH_CELERY_CHAIN": "0"},
        "celery's": {"SAGA_BENCH_CELERY_CHAIN": "1"},
    },
    "failure": {
        "with it": {"SAGA_BENCH_FAILURE_APART": "0"},
        "apart": {"SAGA_BENCH_FAILURE_APART": "1"},
    },
    "conclusion": {
        "with it": {"SAGA_BENCH_CONCLUSION_APART": "0"},
        "apart": {"SAGA_BENCH_CONCLUSION_APART": "1"},
    },
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cut", choices=sorted(CUTS), default="chain")
    parser.add_argument("--blocks", type=int, default=3, help="blocks per way")
    parser.add_argument("--runs", type=int, default=200, help="failing runs per block")
    parser.add_argument(
        "--durable", action="store_true", help="the Redis syncs every write (appendfsync always)"
    )
    args = parser.parse_args(argv)
    import redis

    from saga.testing import RedisServer, WorkerProcess

    persistence = ("--appendonly", "yes", "--appendfsync", "always") if args.durable else ()
    server = RedisServer(*(persistence or ("--appendonly", "no"))).start()
    ways = CUTS[args.cut]
    figures: dict[str, dict[str, list[float]]] = {
        way: {
            "handle_failure": [],
            "start_unwind": [],
            "record_failure": [],
            "children": [],
            "main": [],
            "runs/s": [],
        }
        for way in ways
    }
    try:
        env = costs.bench_environment(server.url, "saga-failures-")
        client = redis.Redis.from_url(server.url)
        # Imported once the environment names the benchmark's Redis (the apps read it once).
        from benchmarks import bench_app
        from benchmarks.failures_app import (
            FAILURE_CPU_KEY,
            RECORD_FAILURE_CPU_KEY,
            UNWIND_CPU_KEY,
        )
        from benchmarks.peers import celery_drivers

        bench_app.saga.records  # noqa: B018 - made before the first timed run
        drive = celery_drivers(client)["saga-fail"]
        pool = ThreadPoolExecutor(max_workers=8)
        for block in range(args.blocks):
            # Which way goes first alternates too: the first of a pair ran slower here.
            order = list(ways.items())
            for way, way_env in order if block % 2 == 0 else order[::-1]:
                worker = WorkerProcess(
                    "benchmarks.failures_app",
                    env={**env, **way_env},
                    concurrency=2,
                    cwd=ROOT,
                )
                with worker:
                    list(pool.map(drive, range(20)))  # warm-up: scripts, statements, imports
                    client.delete(FAILURE_CPU_KEY, UNWIND_CPU_KEY, RECORD_FAILURE_CPU_KEY)
                    main_cpu = costs.process_cpu(worker.pid, descendants=False)
                    both_cpu = costs.process_cpu(worker.pid)
                    began = time.perf_counter()
                    list(pool.map(drive, range(args.runs)))
                    rate = args.runs / (time.perf_counter() - began)
                    spent = float(client.get(FAILURE_CPU_KEY) or 0)
                    unwinding = float(client.get(UNWIND_CPU_KEY) or 0)
                    recording = float(client.get(RECORD_FAILURE_CPU_KEY) or 0)
                    main_cpu = costs.process_cpu(worker.pid, descendants=False) - main_cpu
                    both_cpu = costs.process_cpu(worker.pid) - both_cpu
                per_run = 1000 / args.runs
                figures[way]["handle_failure"].append(spent * per_run)
                figures[way]["start_unwind"].append(unwinding * per_run)
                figures[way]["record_failure"].append(recording * per_run)
                figures[way]["children"].append((both_cpu - main_cpu) * per_run)
                figures[way]["main"].append(main_cpu * per_run)
                figures[way]["runs/s"].append(rate)
        client.close()
    finally:
        server.stop()
    print(
        f"--cut {args.cut}{' --durable' if args.durable else ''}: {args.blocks} blocks of "
        f"{args.runs} failing runs per way, alternated; medians of runs/s and of "
        "CPU ms per run"
    )
    for way, values in figures.items():
        cells = "   ".join(f"{k} {statistics.median(v):6.2f}" for k, v in values.items())
        print(f"  {way:10s} {cells}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
