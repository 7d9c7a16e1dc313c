"""What a step costs as the work grows: 10, 1,000 and 10,000 runs open at once.

Open runs are waiting, not busy: each was started and had one step recorded (through the
store's scripts, as a worker records it), then left open, as runs whose agent is thinking.
With each count open, the benchmark's happy runs (``benchmarks/steps.py``, K in flight, one
prefork worker) are driven and metered: CPU per step (caller, worker and Redis, from /proc and
INFO), Redis commands per step (INFO commandstats), and solo latency per step. Then the
reaper's pass is timed against the same open runs (none of them due: it reads only the due
ones), and Redis's memory is read per open run and per recorded step. The broker and results
are on a Redis of their own (``broker``), so ``redis`` is the store alone: its CPU per run is
what one shard spends, and ``1000 /`` that is the shard's ceiling in runs/s (``store:`` line).

Flat is the goal: nothing on the hot path may scan every run. The last line:
``scale: per-step cpu at 10000 open runs / at 10: X.XX``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks import costs, steps  # noqa: E402

TIMEOUT = 60.0
STEPS_PER_RUN = 4


def open_runs(saga: Any, count: int, pool: ThreadPoolExecutor) -> None:
    """Start ``count`` runs, each with one step recorded as a worker records it."""
    from saga.model import ToolClass
    from saga.rules import gate_for

    store = saga.store
    gate = gate_for(ToolClass.READ)
    args = '{"order_id":4921}'
    result = '{"order_id":4921,"customer_email":"ada@example.com","total_cents":499900}'

    def one(_: int) -> None:
        run_id = saga.start_run().run_id
        step = int(store.reserve(run_id, "get_order", ToolClass.READ, args, gate).values[0])
        store.begin_step(run_id, step, "get_order", args, f"{run_id}/open", 300.0)
        store.record_success(run_id, step, result, "", False)

    list(pool.map(one, range(count)))


def measure(
    saga: Any, client: Any, pids: dict[str, int], args: argparse.Namespace
) -> dict[str, float]:
    """Per step, with whatever is open now: CPU ms by process and in all, the store's commands,
    solo ms."""
    meter = costs.Meter(client, pids)
    pool = ThreadPoolExecutor(max_workers=args.inflight)
    try:
        list(pool.map(lambda i: steps.drive_saga(saga, i, False, TIMEOUT), range(args.inflight)))
        meter.start()
        list(pool.map(lambda i: steps.drive_saga(saga, i, False, TIMEOUT), range(args.runs)))
        cpu, commands = meter.stop()
    finally:
        pool.shutdown()
    per_step = args.runs * STEPS_PER_RUN
    row = {f"{name} ms": 1000 * seconds / per_step for name, seconds in cpu.items()}
    row["cpu ms"] = sum(row.values())
    row["cmds"] = commands / per_step
    solo = []
    for i in range(args.solo):
        start = time.perf_counter()
        steps.drive_saga(saga, i, False, TIMEOUT)
        solo.append((time.perf_counter() - start) * 1000 / STEPS_PER_RUN)
    row["solo p50 ms"] = statistics.median(solo)
    return row


def reaper_pass(saga: Any) -> float:
    """Milliseconds of one reaper pass over what is open now (best of three)."""
    timings = []
    for _ in range(3):
        start = time.perf_counter()
        saga.reap()
        timings.append((time.perf_counter() - start) * 1000)
    return min(timings)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--open", default="10,1000,10000", help="open runs, comma-separated")
    parser.add_argument("--runs", type=int, default=80, help="runs driven per measurement")
    parser.add_argument("--inflight", type=int, default=8, help="runs driven at once")
    parser.add_argument("--solo", type=int, default=10, help="solo runs for latency")
    args = parser.parse_args(argv)
    counts = [int(c) for c in args.open.split(",")]

    import redis

    from saga.testing import RedisServer, WorkerProcess

    server = RedisServer("--appendonly", "no").start()
    broker = RedisServer("--appendonly", "no").start()
    assert broker.process is not None
    env = costs.bench_environment(broker.url, "saga-scale-", store_url=server.url)
    tmp = Path(env["SAGA_DEMO_DATA"]).parent
    from tasks import systems

    client = redis.Redis.from_url(server.url)
    worker = WorkerProcess("benchmarks.bench_app", env=env, cwd=ROOT, logfile=tmp / "worker.log")
    rows: dict[int, dict[str, float]] = {}
    memory: dict[str, float] = {}
    try:
        worker.start()
        from benchmarks import bench_app

        saga = bench_app.saga
        opener = ThreadPoolExecutor(max_workers=8)
        opened = 0
        for count in counts:
            before = int(client.info("memory")["used_memory"])
            open_runs(saga, count - opened, opener)
            if count > opened:
                grown = int(client.info("memory")["used_memory"]) - before
                memory[f"per open run (one step), {count - opened} opened"] = grown / (
                    count - opened
                )
            opened = count
            pids = {"worker": worker.pid, "broker": broker.process.pid}
            rows[count] = measure(saga, client, pids, args)
            rows[count]["reaper pass ms"] = reaper_pass(saga)
        opener.shutdown()
        memory["per step (a run's 4 steps, recorded and ended)"] = per_step_memory(saga, client)
    except Exception:
        print(worker.log()[-3000:], file=sys.stderr)
        raise
    finally:
        worker.stop()
        systems.dispose_engines()
        client.close()
        server.stop()
        broker.stop()
    print(f"per step, {args.runs} happy runs driven ({args.inflight} in flight) per count")
    for count, row in rows.items():
        cells = "  ".join(f"{name} {value:.2f}" for name, value in row.items())
        print(f"  {count:>6} open: {cells}")
    for what, value in memory.items():
        print(f"redis memory {what}: {value:.0f} bytes")
    store_ms = {count: row["redis ms"] * STEPS_PER_RUN for count, row in rows.items()}
    cells = ", ".join(
        f"{ms:.2f} ms at {count} open (ceiling {1000 / ms:.0f} runs/s)"
        for count, ms in store_ms.items()
    )
    print(f"store: redis cpu per happy run, the store alone: {cells}")
    ratio = rows[counts[-1]]["cpu ms"] / rows[counts[0]]["cpu ms"]
    print(f"scale: per-step cpu at {counts[-1]} open runs / at {counts[0]}: {ratio:.2f}")
    return 0


def per_step_memory(saga: Any, client: Any) -> float:
    """Bytes per step a run keeps in Redis until its keys expire: a run with no step against
    one with the benchmark's four, both ended and recorded, told apart over 200 of each."""
    before = int(client.info("memory")["used_memory"])
    for _ in range(200):
        saga.start_run().finish(TIMEOUT)
    empty = int(client.info("memory")["used_memory"]) - before
    before = int(client.info("memory")["used_memory"])
    for i in range(200):
        steps.drive_saga(saga, i, False, TIMEOUT)
    full = int(client.info("memory")["used_memory"]) - before
    return (full - empty) / (200 * STEPS_PER_RUN)


if __name__ == "__main__":
    sys.exit(main())
