"""What saga costs: the demo's four steps as a bare Celery chain versus as saga runs.

Fair because both modes run in one process run, on ONE worker (``benchmarks.bench_app``: the
demo app plus four plain tasks), with the same Celery config, the same pool, the same three
SQLite systems and the same work per step (``tasks.systems`` calls with a unique idempotency
key). Rounds alternate (bare, saga, bare, saga ...) so drift (growing tables, a warming cache,
a noisy neighbour) hits both modes alike, and K runs are in flight at once in both.

What differs is what saga is: each saga run is driven the way an agent drives it, waiting for
each step's result before choosing the next, and each step goes through the dispatcher
(validation, the pivot gate and reservation in one Lua call), records its outcome and pushes
its undo in Redis before the ack, and the client blocks until that record settles;
``finish()`` concludes the run and writes its record to SQL. The bare chain hands each result
worker to worker and reports once.

The last line, ``saga/bare throughput ratio: X.XX``, is saga runs/s ÷ bare runs/s (each the
median over its rounds): 1.00 means saga is free, 0.90 (the target) means 10 % fewer runs/s.
Timings are reported, never asserted: the exit status is non-zero only if a run failed or a
wait timed out.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import redis

ROOT = Path(__file__).resolve().parents[1]
#: The Redis database index this benchmark owns: flushed before and after.
BENCH_DB = int(os.environ.get("SAGA_BENCH_REDIS_DB", "12"))
ORDER, TICKET, EMAIL = 4921, 9104, "ada@example.com"
STATUSES = ("waiting_on_customer", "open")
SUBJECT, BODY = "Your credit", "We credited $1.00 to order 4921."
TIMEOUT = 60.0  # every single wait (a step, a chain, a finish)
SOLO_RUNS = 15

Driver = Callable[[int], None]


def environment(tmp: Path) -> dict[str, str]:
    """Dedicated Redis DB, throwaway systems and records: set here and in the worker."""
    base = os.environ.get("SAGA_REDIS_URL", "redis://localhost:6379")
    url = re.sub(r"(/\d+)?/?$", "", base, count=1) + f"/{BENCH_DB}"
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    return {
        "SAGA_REDIS_URL": url,
        "SAGA_BROKER_URL": url,
        "SAGA_RESULT_BACKEND": url,
        "SAGA_DEMO_DATA": str(tmp / "data"),
        "SAGA_DATABASE_URL": f"sqlite:///{tmp / 'records.db'}",
        "PYTHONPATH": path,
    }


def drivers(client: redis.Redis) -> dict[str, Driver]:
    """One run of each mode; imported late, once the environment points at the bench DB."""
    from celery import chain

    from benchmarks import bench_app as b

    def bare(i: int) -> None:
        key = f"bench-{uuid.uuid4().hex}"
        chain(
            b.get_order.s(ORDER),
            b.issue_credit.s(100, key),
            b.set_ticket_status.s(TICKET, STATUSES[i % 2], key),
            b.send_reply.s(EMAIL, SUBJECT, BODY, key),
        ).apply_async()
        if client.blpop([b.DONE_PREFIX + key], timeout=TIMEOUT) is None:
            raise TimeoutError(f"bare chain {key} did not finish within {TIMEOUT:.0f} s")

    def saga(i: int) -> None:
        run = b.saga.start_run()
        order = run.call("get_order", order_id=ORDER).result(TIMEOUT)
        credit = run.call("issue_credit", order_id=order["order_id"], amount_cents=100)
        credit.result(TIMEOUT)
        run.call("set_ticket_status", ticket_id=TICKET, status=STATUSES[i % 2]).result(TIMEOUT)
        mail = run.call("send_reply", to=order["customer_email"], subject=SUBJECT, body=BODY)
        mail.result(TIMEOUT)
        run.finish(TIMEOUT)

    return {"bare": bare, "saga": saga}


def throughput(drive: Driver, runs: int, pool: ThreadPoolExecutor) -> float:
    """Runs/s with the pool's threads keeping K runs in flight; raises a run's error."""
    start = time.perf_counter()
    futures = [pool.submit(drive, i) for i in range(runs)]
    for future in futures:
        future.result(timeout=6 * TIMEOUT)
    return runs / (time.perf_counter() - start)


def solo_latencies(modes: dict[str, Driver]) -> dict[str, list[float]]:
    """Milliseconds per run with nothing else in flight, modes interleaved run by run."""
    samples: dict[str, list[float]] = {mode: [] for mode in modes}
    for i in range(SOLO_RUNS):
        for mode, drive in modes.items():
            start = time.perf_counter()
            drive(i)
            samples[mode].append((time.perf_counter() - start) * 1000)
    return samples


def p95(values: list[float]) -> float:
    return statistics.quantiles(values, n=20, method="inclusive")[18]


def measure(args: argparse.Namespace, modes: dict[str, Driver]) -> float:
    """Warm up, alternate rounds, time solo runs, print the table; return the ratio."""
    per_round = max(1, args.runs // args.rounds)
    rates: dict[str, list[float]] = {mode: [] for mode in modes}
    pool = ThreadPoolExecutor(max_workers=args.inflight, thread_name_prefix="run")
    try:
        for drive in modes.values():  # warm-up: imports, connections, SQLite pages, Lua
            throughput(drive, args.inflight, pool)
        for _ in range(args.rounds):
            for mode, drive in modes.items():
                rates[mode].append(throughput(drive, per_round, pool))
    finally:  # after a failure, drop the queued runs instead of waiting for each to time out
        pool.shutdown(wait=False, cancel_futures=True)
    solo = solo_latencies(modes)

    print(
        f"{args.rounds} rounds per mode of {per_round} runs, {args.inflight} in flight, "
        f"worker concurrency {args.concurrency}; solo latency over {SOLO_RUNS} runs"
    )
    print(f"{'mode':<6}{'runs':>6}{'runs/s':>10}{'solo p50 ms':>14}{'solo p95 ms':>14}")
    for mode in modes:
        rate = statistics.median(rates[mode])
        p50, top = statistics.median(solo[mode]), p95(solo[mode])
        print(f"{mode:<6}{per_round * args.rounds:>6}{rate:>10.1f}{p50:>14.1f}{top:>14.1f}")
    print(
        "runs/s: median over rounds; bare = one 4-task chain, results passed worker to worker; "
        "saga = 4 agent-driven steps (dispatch, wait, next) with undo pushes + finish(); "
        "target ratio >= 0.90"
    )
    # Each saga round over the bare round just before it: how far apart rounds a few seconds
    # apart land on this machine, which is how far a single ratio can be trusted.
    pairs = sorted(s / b for b, s in zip(rates["bare"], rates["saga"], strict=True))
    print(
        f"saga/bare per pair of rounds: lowest {pairs[0]:.2f}, median "
        f"{statistics.median(pairs):.2f}, highest {pairs[-1]:.2f}"
    )
    return statistics.median(rates["saga"]) / statistics.median(rates["bare"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=300, help="runs per mode (all rounds)")
    parser.add_argument("--rounds", type=int, default=6, help="alternating rounds per mode")
    parser.add_argument("--concurrency", type=int, default=2, help="worker pool size")
    parser.add_argument("--inflight", type=int, default=8, help="runs driven at once")
    args = parser.parse_args(argv)
    if min(args.runs, args.rounds, args.concurrency, args.inflight) < 1:
        parser.error("every count must be at least 1")

    with tempfile.TemporaryDirectory(prefix="saga-bench-") as tmp:
        env = environment(Path(tmp))
        os.environ.update(env)  # before tasks.app reads its configuration
        sys.path.insert(0, str(ROOT))
        client = redis.Redis.from_url(env["SAGA_REDIS_URL"], socket_connect_timeout=5)
        client.flushdb()

        from saga.testing import WorkerProcess
        from tasks import systems
        from tasks.app import saga

        systems.reset()  # one order (total $4,999) and one open ticket
        records = saga.records  # created up front so its first use is not timed

        modes = drivers(client)
        worker = WorkerProcess(
            "benchmarks.bench_app",
            env=env,
            concurrency=args.concurrency,
            cwd=ROOT,
            logfile=Path(tmp) / "worker.log",
        )
        try:
            worker.start()
            ratio = measure(args, modes)
        except Exception as exc:
            print(f"benchmark failed: {type(exc).__name__}: {exc}", file=sys.stderr)
            print(worker.log()[-3000:], file=sys.stderr)
            return 1
        finally:
            worker.stop()
            systems.dispose_engines()
            records.dispose()
            client.flushdb()
            client.close()
    print(f"saga/bare throughput ratio: {ratio:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
