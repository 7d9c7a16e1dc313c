"""Where the durable pass's time goes: how many times the store's Redis waits for the disk per
run, by contender and topology.

With ``appendfsync always`` Redis answers a write only once the AOF holds it on disk, and it
syncs once per turn of its event loop, for every write that turn brought: a write on a run's
critical path waits for one ``fdatasync``, and writes sent together share one. This counts
the ``fdatasync`` calls of the store's ``redis-server`` (``strace -c``) over serial runs (one
at a time: no other run shares a sync), for the bare Celery chain and for saga, happy and
failing, on one Redis (``single``: the broker's writes sync too) and with the broker and
results on a Redis of their own without an AOF (``split``: the store syncs saga's writes
alone). Serial runs, so the count is the number of disk waits a run's writes make, whatever
the machine's load. A second line gives the microseconds per ``fdatasync`` as ``strace``
sees them (its own overhead included). Needs ``strace`` (Debian: ``apt-get install strace``)
and the right to trace a child (root, or ``kernel.yama.ptrace_scope`` 0).

    python benchmarks/fsyncs.py [--runs N] [--topology single|split]
"""

from __future__ import annotations

import argparse
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks import costs  # noqa: E402

MODES = ("bare-happy", "saga-happy", "bare-fail", "saga-fail")


def syncs_of(strace_summary: str) -> tuple[int, int]:
    """The ``fdatasync`` call count in ``strace -c``'s table, and its microseconds per call
    (the disk's wait as the tracer sees it, its own overhead included); (0, 0) if none."""
    return costs.strace_row(strace_summary, "fdatasync")


def measure(topology: str, runs: int) -> dict[str, tuple[float, int]]:
    """``fdatasync`` calls of the store per run, and microseconds per call, by mode, for one
    topology."""
    import redis

    from saga.testing import RedisServer, WorkerProcess

    store = RedisServer("--appendonly", "yes", "--appendfsync", "always").start()
    broker = RedisServer("--appendonly", "no").start() if topology == "split" else None
    if broker is not None:
        env = costs.bench_environment(broker.url, "saga-fsyncs-", store_url=store.url)
    else:
        env = costs.bench_environment(store.url, "saga-fsyncs-")
    client = redis.Redis.from_url(store.url)
    worker = WorkerProcess("benchmarks.bench_app", env=env, concurrency=2, cwd=ROOT)
    counts: dict[str, tuple[float, int]] = {}
    try:
        worker.start()
        from benchmarks.peers import celery_drivers

        drivers = celery_drivers(client)
        assert store.process is not None
        for mode in MODES:
            for i in range(5):  # imports, connections, scripts
                drivers[mode](i)
            with tempfile.NamedTemporaryFile(suffix=".strace") as out:
                trace = ["strace", "-f", "-c", "-e", "trace=fdatasync", "-o", out.name]
                tracer = subprocess.Popen(
                    [*trace, "-p", str(store.process.pid)], stderr=subprocess.DEVNULL
                )
                time.sleep(1.0)  # attached
                for i in range(runs):
                    drivers[mode](1000 + i)
                time.sleep(0.5)  # the last run's writes synced
                tracer.send_signal(signal.SIGINT)
                tracer.wait(10)
                calls, micros = syncs_of(Path(out.name).read_text())
                counts[mode] = calls / runs, micros
    finally:
        worker.stop()
        client.close()
        store.stop()
        if broker is not None:
            broker.stop()
    return counts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=30, help="serial runs per mode")
    parser.add_argument("--topology", choices=("single", "split"), action="append")
    args = parser.parse_args(argv)
    if shutil.which("strace") is None:
        parser.error("strace is not installed (Debian: apt-get install strace)")
    topologies = args.topology or ["single", "split"]
    if len(topologies) > 1:  # each in a process of its own: the saga app binds its Redis at import
        for topology in topologies:
            command = [sys.executable, __file__, "--runs", str(args.runs), "--topology", topology]
            subprocess.run(command, check=True)
        return 0
    counts = measure(topologies[0], args.runs)
    cells = "  ".join(f"{mode} {value:.1f}" for mode, (value, _) in counts.items())
    print(f"{topologies[0]}: fdatasync of the store per run (serial runs): {cells}")
    cells = "  ".join(f"{mode} {micros}" for mode, (_, micros) in counts.items())
    print(f"{topologies[0]}: microseconds per fdatasync (strace): {cells}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
