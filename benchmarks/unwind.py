"""Round four's cuts measured where they are, alternated with the code they replaced in one
process: an engine harness (``tests/integration/engine_harness.py``: real Redis, real scripts,
the worker's own functions, a broker the benchmark holds) drives runs one at a time, with no
Celery worker, so what is measured is saga's own work on the run and nothing else.

The runs: a happy one (two credits, then the caller's ``complete``) and a failing one (two
credits, a stock hold that fails for good, two reversals, the conclusion in the last one's
task). Blocks of runs take turns, one block the way the code now works, the next the way it
worked before round four, put back by patching the store and the records in this process:

- the final failure recorded, then the run read apart (``record_final_failure`` reads it back
  in the same transaction);
- the last undo recorded, then the run read apart (``record_last_compensation``);
- the end marked recorded, then the reaper's index entry written apart (``mark_recorded``
  writes it in its script);
- the unwind's check against SQL loading the run's row (``recorded_as`` reads two columns).

``--cut packer`` alternates instead the store's connections packing commands with hiredis
(``saga.redis_packer``) and with redis-py's own packer.

Prints, per way and path, the medians over the blocks of this process's CPU ms per run (the
caller's and the worker's work together, SQLite included), the Redis server's CPU ms per run,
and the round trips to Redis per run (counted, not timed).

    PYTHONPATH=. python benchmarks/unwind.py [--blocks 8] [--runs 50] [--cut packer]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

WAYS = ("now", "before")


class RoundTrips:
    """Counts the commands and pipelines redis-py sends (one write of packed commands each)."""

    def __init__(self) -> None:
        from redis.connection import Connection

        self.count = 0
        real = Connection.send_packed_command

        def counted(connection: Any, command: Any, check_health: bool = True) -> None:
            self.count += 1
            real(connection, command, check_health)

        Connection.send_packed_command = counted  # type: ignore[method-assign]


def the_way_before(h: Any) -> Callable[[], None]:
    """Put back, on this harness, the round trips round four removed; returns the undo."""
    from saga.constants import LOOK_AFTER_EXPIRY

    store, records = h.saga.store, h.saga.records

    def record_final_failure(run_id: str, step: int, error: Any) -> Any:
        return store.record_failure(run_id, step, error, "fail"), None

    def record_last_compensation(
        run_id: str, step: int, outcome: str, error: Any, claim: str
    ) -> Any:
        return store.record_compensation(run_id, step, outcome, error, claim), None

    def mark_recorded(run_id: str, version: str, notify: bool = True) -> bool:
        if not store._mark_recorded(run_id, version, notify, ""):
            return False
        store.schedule(run_id, store.now() + store.retention_seconds + LOOK_AFTER_EXPIRY)
        return True

    def recorded_as(run_id: str) -> Any:
        record = records.run(run_id)
        return None if record is None else (record.state, record.version)

    patches = {
        (store, "record_final_failure"): record_final_failure,
        (store, "record_last_compensation"): record_last_compensation,
        (store, "mark_recorded"): mark_recorded,
        (records, "recorded_as"): recorded_as,
    }
    for (owner, name), patch in patches.items():
        setattr(owner, name, patch)

    def undo() -> None:
        for owner, name in patches:
            delattr(owner, name)

    return undo


def the_packer_before(h: Any) -> Callable[[], None]:
    """Put back redis-py's own command packer on the store's connections; returns the undo."""
    pool = h.saga.store.client.connection_pool
    packer = pool.connection_kwargs.pop("command_packer")

    def fresh_connections() -> None:
        pool.disconnect()
        pool.reset()

    fresh_connections()

    def undo() -> None:
        pool.connection_kwargs["command_packer"] = packer
        fresh_connections()

    return undo


CUTS = {"round-four": the_way_before, "packer": the_packer_before}


def credits(h: Any, run_id: str) -> None:
    for amount in (100, 200):
        step = h.saga.dispatch(run_id, "issue_credit", {"amount": amount}).step
        h.deliver(h.take("tools.issue_credit", run_id=run_id, step=step))


def happy_run(h: Any) -> None:
    run_id = h.start()
    credits(h, run_id)
    if not h.saga.core.complete(run_id).recorded:
        raise RuntimeError(f"run {run_id} was not recorded")


def failing_run(h: Any) -> None:
    from saga import RunState

    run_id = h.start()
    credits(h, run_id)
    h.world.failing_holds = 2  # both attempts of the hold fail: the run unwinds
    step = h.saga.dispatch(run_id, "hold_stock", {"sku": "A-1"}).step
    h.deliver(h.take("tools.hold_stock", run_id=run_id, step=step))
    h.drain()  # the second attempt, then the chain of two reversals
    picture = h.saga.picture(run_id)
    if picture.state is not RunState.COMPENSATED or not picture.recorded:
        raise RuntimeError(f"run {run_id} ended {picture.state.value}, not compensated")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--blocks", type=int, default=8, help="blocks per way and path")
    parser.add_argument("--runs", type=int, default=50, help="runs per block")
    parser.add_argument("--cut", choices=sorted(CUTS), default="round-four", help="what to A/B")
    args = parser.parse_args(argv)
    before = CUTS[args.cut]
    import redis

    from benchmarks import costs
    from saga.testing import RedisServer
    from tests.integration.engine_harness import harness

    server = RedisServer("--appendonly", "no").start()
    counter = RoundTrips()
    paths = {"happy": happy_run, "failing": failing_run}
    cpu: dict[tuple[str, str], list[float]] = {(p, w): [] for p in paths for w in WAYS}
    server_cpu: dict[tuple[str, str], list[float]] = {(p, w): [] for p in paths for w in WAYS}
    trips: dict[tuple[str, str], list[float]] = {(p, w): [] for p in paths for w in WAYS}
    try:
        admin = redis.Redis.from_url(server.url)
        with tempfile.TemporaryDirectory(prefix="saga-unwind-") as data:
            for h in harness(server.url, Path(data)):
                for drive in paths.values():
                    for _ in range(10):  # warm-up: scripts loaded, statements compiled
                        drive(h)
                for _ in range(args.blocks):
                    for path, drive in paths.items():
                        for way in WAYS:
                            undo = before(h) if way == "before" else None
                            started, sent = time.process_time(), counter.count
                            on_server = costs.redis_cpu(admin)
                            for _ in range(args.runs):
                                drive(h)
                            runs = args.runs
                            cpu[path, way].append((time.process_time() - started) / runs * 1000)
                            server_cpu[path, way].append(
                                (costs.redis_cpu(admin) - on_server) / runs * 1000
                            )
                            trips[path, way].append((counter.count - sent) / runs)
                            if undo is not None:
                                undo()
                            h.run_ids.clear()
                            h.saga.store.client.flushdb()
        admin.close()
    finally:
        server.stop()
    print(
        f"{args.cut}: {args.blocks} blocks of {args.runs} runs per way and path, alternated; "
        "medians per run"
    )
    for path in paths:
        for way in WAYS:
            key = (path, way)
            print(
                f"  {path:8s} {way:7s} process CPU ms {statistics.median(cpu[key]):6.3f}   "
                f"Redis CPU ms {statistics.median(server_cpu[key]):6.3f}   "
                f"round trips {statistics.median(trips[key]):5.1f}"
            )
        now, before = statistics.median(cpu[path, "now"]), statistics.median(cpu[path, "before"])
        lower = sum(n < b for n, b in zip(cpu[path, "now"], cpu[path, "before"], strict=True))
        print(
            f"  {path:8s} now / before: process CPU {now / before:.3f}x "
            f"(now lower in {lower} of {args.blocks} blocks)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
