"""saga against its peers: the demo's four steps as a bare Celery chain, as saga runs, and as a
DBOS Transact workflow on PostgreSQL and on SQLite, happy and failing, from one process run.

Every contender does the same work (``benchmarks.steps``: three SQLite systems, one
idempotency key per step). Failing: the fourth step bounces and the two undos run, newest
first (saga unwinds; the bare chain's fourth task sends them as a chain; DBOS runs them in its
workflow's except block). Celery runs one prefork worker (``benchmarks.bench_app``); DBOS runs
in its own process (``benchmarks/dbos_peer.py``, in ``.venv-peers``). K runs are in flight at
once in every mode, and rounds are interleaved (bare, saga, dbos-pg, dbos-sqlite, bare, ...)
so drift hits all alike.

Three passes, each with its own redis-server and PostgreSQL database (made here, dropped
after): *normal* (Redis without an AOF, PostgreSQL ``synchronous_commit=off``: neither waits
for the disk; saga's records, in SQLite, are synced at each commit in every pass, as the
library does), *durable* (Redis ``appendfsync always``, PostgreSQL ``synchronous_commit=on``)
and *replicated* (durable, with one replica confirming each of saga's writes that count,
``SAGA_REDIS_CONFIRM_REPLICAS=1``: saga alone, for what the confirmation costs).

Reported per run: CPU milliseconds by process (the caller: this process's driver threads; the
Celery worker with its pool; Redis; the DBOS process; PostgreSQL's backends for our database),
Redis commands (``INFO commandstats``, script-internal calls included), runs/s (median of the
rounds) and solo latency p50. Timings are reported, never asserted. The last line:
``peers: saga/dbos-pg happy X fail Y; durable happy X fail Y; saga/bare cpu happy X fail Y;
ceiling bare/dbos-pg happy X fail Y`` (the bare chain's runs/s over DBOS's in the same
invocation: what a Celery engine with no saga at all reaches against DBOS on this machine),
after ``replica confirmation: saga replicated/durable ...`` (the confirmation's cost).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks import costs, steps  # noqa: E402

TIMEOUT = 60.0
PEERS_PYTHON = ROOT / ".venv-peers" / "bin" / "python"
DEFAULT_PG = "postgresql+psycopg://postgres@127.0.0.1:5432/test"

Driver = Callable[[int], None]


class DbosPeer:
    """The DBOS driver process, one per database, spoken to one JSON line at a time."""

    def __init__(self, url: str, inflight: int, env: dict[str, str]) -> None:
        command = [str(PEERS_PYTHON), "-m", "benchmarks.dbos_peer", "--database-url", url]
        self.process = subprocess.Popen(
            [*command, "--inflight", str(inflight)],
            cwd=ROOT,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self.ask({})  # its first line says it launched

    def ask(self, request: dict[str, Any]) -> dict[str, Any]:
        assert self.process.stdin is not None and self.process.stdout is not None
        if request:
            self.process.stdin.write(json.dumps(request) + "\n")
            self.process.stdin.flush()
        line = self.process.stdout.readline()
        if not line:
            raise RuntimeError(f"the DBOS driver exited ({self.process.poll()})")
        return dict(json.loads(line))

    def stop(self) -> None:
        if self.process.poll() is None:
            assert self.process.stdin is not None
            self.process.stdin.write(json.dumps({"op": "stop"}) + "\n")
            self.process.stdin.flush()
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)


def postgres_database(base: str, durable: bool) -> tuple[str, Callable[[], None]]:
    """A database of our own on the server at ``base``; returns its URL and how to drop it."""
    import psycopg

    plain = base.replace("postgresql+psycopg://", "postgresql://")
    name = f"saga_peers_{os.getpid()}_{int(durable)}"
    admin = psycopg.connect(plain, autocommit=True)
    admin.execute(f'DROP DATABASE IF EXISTS "{name}"')
    admin.execute(f'CREATE DATABASE "{name}"')
    setting = "on" if durable else "off"
    admin.execute(f'ALTER DATABASE "{name}" SET synchronous_commit = {setting}')
    url = plain.rsplit("/", 1)[0] + f"/{name}"

    def drop() -> None:
        admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        admin.close()

    return url, drop


def backend_cpu(url: str) -> Callable[[], float]:
    """CPU seconds of PostgreSQL's backends serving ``url``'s database (read from /proc:
    the server must run on this machine)."""
    import psycopg

    watcher = psycopg.connect(url, autocommit=True)
    own = watcher.info.backend_pid
    seen: dict[int, float] = {}

    def read() -> float:
        rows = watcher.execute(
            "SELECT pid FROM pg_stat_activity WHERE datname = current_database()"
        ).fetchall()
        for (pid,) in rows:
            if pid != own:
                seen[pid] = max(seen.get(pid, 0.0), costs.process_cpu(pid))
        return sum(seen.values())

    return read


def celery_drivers(client: Any) -> dict[str, Driver]:
    """Bare and saga runs, happy and failing; imported once the environment is set."""
    from celery import chain

    from benchmarks import bench_app as b

    def bare(i: int, fail: bool) -> None:
        key = f"bench-{uuid.uuid4().hex}"
        status = steps.STATUSES[i % 2]
        last = (
            b.send_reply_bounced_task.s(steps.EMAIL, key)
            if fail
            else b.send_reply.s(steps.EMAIL, steps.SUBJECT, steps.BODY, key)
        )
        chain(
            b.get_order.s(steps.ORDER),
            b.issue_credit.s(steps.AMOUNT_CENTS, key),
            b.set_ticket_status.s(steps.TICKET, status, key),
            last,
        ).apply_async()
        if client.blpop([b.DONE_PREFIX + key], timeout=TIMEOUT) is None:
            raise TimeoutError(f"bare chain {key} did not finish within {TIMEOUT:.0f} s")

    def saga(i: int, fail: bool) -> None:
        steps.drive_saga(b.saga, i, fail, TIMEOUT)

    return {
        "bare-happy": lambda i: bare(i, False),
        "bare-fail": lambda i: bare(i, True),
        "saga-happy": lambda i: saga(i, False),
        "saga-fail": lambda i: saga(i, True),
    }


def throughput(drive: Driver, runs: int, pool: ThreadPoolExecutor) -> float:
    start = time.perf_counter()
    for future in [pool.submit(drive, i) for i in range(runs)]:
        future.result(timeout=6 * TIMEOUT)
    return runs / (time.perf_counter() - start)


class Contenders:
    """The modes of one pass, driven alike: a round of runs, metered; solo runs, timed."""

    def __init__(
        self,
        drivers: dict[str, Driver],
        peers: dict[str, DbosPeer],
        pool: ThreadPoolExecutor,
        meter: costs.Meter,
    ) -> None:
        self.drivers, self.peers, self.pool, self.meter = drivers, peers, pool, meter

    def round(self, mode: str, path: str, runs: int) -> float:
        if mode in self.peers:
            request = {"op": "round", "fail": path == "fail", "runs": runs}
            return float(self.peers[mode].ask(request)["rate"])
        return throughput(self.drivers[f"{mode}-{path}"], runs, self.pool)

    def solo(self, mode: str, path: str, runs: int) -> list[float]:
        if mode in self.peers:
            request = {"op": "solo", "fail": path == "fail", "runs": runs}
            return list(self.peers[mode].ask(request)["ms"])
        times = []
        for i in range(runs):
            start = time.perf_counter()
            self.drivers[f"{mode}-{path}"](i)
            times.append((time.perf_counter() - start) * 1000)
        return times

    def measure(self, path: str, modes: list[str], args: argparse.Namespace) -> dict[str, Any]:
        """Warm up, then interleaved rounds (CPU and commands metered), then solo runs."""
        for mode in modes:  # imports, connections, pages, scripts
            self.round(mode, path, args.inflight * 2)
        results = {m: {"rates": [], "cpu": {}, "commands": 0, "runs": 0} for m in modes}
        for _ in range(args.rounds):
            for mode in modes:
                entry = results[mode]
                self.meter.start()
                entry["rates"].append(self.round(mode, path, args.runs))
                cpu, commands = self.meter.stop()
                for name, seconds in cpu.items():
                    entry["cpu"][name] = entry["cpu"].get(name, 0.0) + seconds
                entry["commands"] += commands
                entry["runs"] += args.runs
        for mode in modes:
            results[mode]["solo_p50"] = statistics.median(self.solo(mode, path, args.solo))
        return {f"{mode}-{path}": entry for mode, entry in results.items()}


def _wait_for_sync(port: int, timeout: float = 30.0) -> None:
    import redis

    client = redis.Redis(port=port, decode_responses=True)
    deadline = time.monotonic() + timeout
    try:
        while client.info("replication").get("master_link_status") != "up":
            if time.monotonic() > deadline:
                raise RuntimeError(f"the replica on {port} did not sync in {timeout:.0f} s")
            time.sleep(0.1)
    finally:
        client.close()


def measure_pass(
    args: argparse.Namespace, durable: bool, replicated: bool = False, split: bool = False
) -> dict[str, Any]:
    """One pass (its own Redis, database, worker and DBOS drivers): every mode's figures.
    ``replicated``: durable, with a replica that confirms saga's writes that count
    (``SAGA_REDIS_CONFIRM_REPLICAS=1``); saga alone runs, for the confirmation's cost.
    ``split``: durable, the broker and results on a Redis of their own without an AOF (its
    CPU is ``broker``; the commands counted are the store's alone)."""
    import redis

    from saga.testing import RedisServer, WorkerProcess

    persistence = ("--appendonly", "yes", "--appendfsync", "always") if durable else ()
    server = RedisServer("--appendonly", "no", *persistence).start()
    broker = RedisServer("--appendonly", "no").start() if split else None
    replica = None
    if replicated:
        replica = RedisServer("--replicaof", "127.0.0.1", str(server.port), *persistence)
        replica.start()
        _wait_for_sync(replica.port)
    pg_url, drop_database = postgres_database(args.postgres, durable)
    if broker is not None:
        env = costs.bench_environment(broker.url, "saga-peers-", store_url=server.url)
    else:
        env = costs.bench_environment(server.url, "saga-peers-")
    if replicated:
        env["SAGA_REDIS_CONFIRM_REPLICAS"] = os.environ["SAGA_REDIS_CONFIRM_REPLICAS"] = "1"
    tmp = Path(env["SAGA_DEMO_DATA"]).parent
    from tasks import systems

    client = redis.Redis.from_url(server.url)
    worker = WorkerProcess(
        "benchmarks.bench_app",
        env=env,
        concurrency=args.concurrency,
        cwd=ROOT,
        logfile=tmp / "worker.log",
    )
    peers: dict[str, DbosPeer] = {}
    pool = ThreadPoolExecutor(max_workers=args.inflight, thread_name_prefix="run")
    try:
        worker.start()
        drivers = celery_drivers(client)
        from benchmarks import bench_app

        bench_app.saga.records  # noqa: B018 - made before the first timed run
        peer_env = {**os.environ, **env}
        if not args.without_dbos and not replicated:
            peers["dbos-pg"] = DbosPeer(pg_url, args.inflight, peer_env)
        if not durable and not args.without_dbos:
            sqlite_url = f"sqlite:///{tmp / 'dbos.db'}"
            peers["dbos-sqlite"] = DbosPeer(sqlite_url, args.inflight, peer_env)
        pg_cpu = backend_cpu(pg_url)
        meter = costs.Meter(
            client,
            {
                "worker": worker.pid,
                **{name: p.process.pid for name, p in peers.items()},
                **({"broker": broker.process.pid} if broker and broker.process else {}),
            },
            {"postgres": pg_cpu},
        )
        # The bare chain on the same Redis is each pass's ceiling: Celery with no saga at all.
        modes = (
            ["bare", "saga", "dbos-pg"] if durable else ["bare", "saga", "dbos-pg", "dbos-sqlite"]
        )
        if replicated:
            modes = ["saga"]
        modes = [m for m in modes if m in ("bare", "saga") or m in peers]
        contenders = Contenders(drivers, peers, pool, meter)
        results: dict[str, Any] = {}
        for path in ("happy", "fail"):
            results.update(contenders.measure(path, modes, args))
        return results
    except Exception:
        print(worker.log()[-3000:], file=sys.stderr)
        raise
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
        for peer in peers.values():
            peer.stop()
        worker.stop()
        systems.dispose_engines()
        client.close()
        if replica is not None:
            replica.stop()
        if broker is not None:
            broker.stop()
        server.stop()
        drop_database()


#: Each pass runs in a process of its own (the saga app binds its Redis at import).
PASSES = ("normal", "durable", "replicated", "split")

#: Which processes' CPU counts for each contender (the caller is this process's drivers).
_CPU_OF = {
    "bare": ("caller", "worker", "redis", "broker"),
    "saga": ("caller", "worker", "redis", "broker"),
    "dbos-pg": ("dbos-pg", "postgres"),
    "dbos-sqlite": ("dbos-sqlite",),
}


def summarise(results: dict[str, Any]) -> dict[str, dict[str, float]]:
    """Per run: CPU ms by process and in all, Redis commands, runs/s (median), solo p50."""
    table: dict[str, dict[str, float]] = {}
    for key, entry in results.items():
        mode = key.rsplit("-", 1)[0]
        runs = entry["runs"]
        names = [name for name in _CPU_OF[mode] if name in entry["cpu"]]
        row = {f"{name} ms": 1000 * entry["cpu"][name] / runs for name in names}
        row["cpu ms"] = sum(row.values())
        if mode in ("bare", "saga"):
            row["redis cmds"] = entry["commands"] / runs
        row["runs/s"] = statistics.median(entry["rates"])
        row["solo p50 ms"] = entry["solo_p50"]
        table[key] = row
    return table


def render(title: str, table: dict[str, dict[str, float]]) -> None:
    print(title)
    for key, row in table.items():
        cells = "  ".join(f"{name} {value:.1f}" for name, value in row.items())
        print(f"  {key:<18}{cells}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=150, help="runs per round")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds per mode")
    parser.add_argument("--concurrency", type=int, default=2, help="Celery worker pool size")
    parser.add_argument("--inflight", type=int, default=8, help="runs driven at once")
    parser.add_argument("--solo", type=int, default=15, help="solo runs for latency")
    parser.add_argument("--pass", dest="only", choices=PASSES, default=None)
    parser.add_argument("--json", action="store_true", help="print the pass's figures as JSON")
    parser.add_argument("--without-dbos", action="store_true", help="bare and saga only")
    args = parser.parse_args(argv)
    args.postgres = os.environ.get("SAGA_TEST_POSTGRES_URL", DEFAULT_PG)
    if not PEERS_PYTHON.exists() and not args.without_dbos:
        parser.error(f"{PEERS_PYTHON} is missing: make bench-peers creates it")
    if args.only:  # one pass, in a process of its own (the saga app binds its Redis at import)
        durable = args.only != "normal"
        table = summarise(
            measure_pass(args, durable, args.only == "replicated", args.only == "split")
        )
        if args.json:
            print(json.dumps(table))
        else:
            render(f"{args.only} pass, per run:", table)
        return 0
    tables = {}
    for name in PASSES:
        command = [sys.executable, __file__, "--pass", name, "--json"]
        command += ["--without-dbos"] if args.without_dbos else []
        command += [f"--runs={args.runs}", f"--rounds={args.rounds}", f"--solo={args.solo}"]
        command += [f"--concurrency={args.concurrency}", f"--inflight={args.inflight}"]
        done = subprocess.run(command, stdout=subprocess.PIPE, text=True, check=True)
        tables[name] = json.loads(done.stdout.strip().splitlines()[-1])
    print(
        f"{args.rounds} interleaved rounds of {args.runs} runs per mode, {args.inflight} in "
        f"flight, one prefork worker with concurrency {args.concurrency}; per run"
    )
    render("normal (Redis without AOF; PostgreSQL synchronous_commit=off):", tables["normal"])
    render(
        "durable (Redis appendfsync always; PostgreSQL synchronous_commit=on):", tables["durable"]
    )
    render(
        "replicated (durable, one replica confirming each write that counts: WAIT):",
        tables["replicated"],
    )
    render(
        "split (durable store; the broker and results on a Redis of their own without an AOF):",
        tables["split"],
    )
    normal, durable, replicated = tables["normal"], tables["durable"], tables["replicated"]
    split = tables["split"]

    def confirmation(path: str, what: str) -> float:
        return replicated[f"saga-{path}"][what] / durable[f"saga-{path}"][what]

    print(
        f"replica confirmation: saga replicated/durable runs/s happy "
        f"{confirmation('happy', 'runs/s'):.2f} fail {confirmation('fail', 'runs/s'):.2f}; "
        f"cpu ms happy {confirmation('happy', 'cpu ms'):.2f} "
        f"fail {confirmation('fail', 'cpu ms'):.2f}; redis cmds happy "
        f"{confirmation('happy', 'redis cmds'):.2f} fail {confirmation('fail', 'redis cmds'):.2f}"
    )

    def ratio(table: dict[str, dict[str, float]], path: str, other: str, what: str) -> float:
        return table[f"saga-{path}"][what] / table[f"{other}-{path}"][what]

    def ceiling(table: dict[str, dict[str, float]], path: str) -> float:
        return table[f"bare-{path}"]["runs/s"] / table[f"dbos-pg-{path}"]["runs/s"]

    if args.without_dbos:
        return 0
    print(
        f"peers: saga/dbos-pg happy {ratio(normal, 'happy', 'dbos-pg', 'runs/s'):.2f} "
        f"fail {ratio(normal, 'fail', 'dbos-pg', 'runs/s'):.2f}; "
        f"durable happy {ratio(durable, 'happy', 'dbos-pg', 'runs/s'):.2f} "
        f"fail {ratio(durable, 'fail', 'dbos-pg', 'runs/s'):.2f}; "
        f"saga/bare cpu happy {ratio(normal, 'happy', 'bare', 'cpu ms'):.2f} "
        f"fail {ratio(normal, 'fail', 'bare', 'cpu ms'):.2f}; "
        f"ceiling bare/dbos-pg happy {ceiling(normal, 'happy'):.2f} "
        f"fail {ceiling(normal, 'fail'):.2f}"
    )
    print(
        f"durable: saga/bare happy {ratio(durable, 'happy', 'bare', 'runs/s'):.2f} "
        f"fail {ratio(durable, 'fail', 'bare', 'runs/s'):.2f}; "
        f"ceiling bare/dbos-pg happy {ceiling(durable, 'happy'):.2f} "
        f"fail {ceiling(durable, 'fail'):.2f}; "
        f"split saga/dbos-pg happy {ratio(split, 'happy', 'dbos-pg', 'runs/s'):.2f} "
        f"fail {ratio(split, 'fail', 'dbos-pg', 'runs/s'):.2f}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
