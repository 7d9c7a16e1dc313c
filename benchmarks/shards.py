"""Where the store's work lands: the same runs against one Redis and against a three-master
Redis Cluster on this machine, per shard.

For each topology (``--topology single,cluster3``) the benchmark starts servers of its own: the
store (``single``: one ``redis-server``; ``cluster3``: three masters with a replica each,
``--replicas``, ``tests/reliability/redis_cluster.py``), and beside it the broker and the
results on a plain ``redis-server`` of their own, so that no broker command counts as the
store's. Then, each phase with workers of its own (started, and stopped by PID, around it):

- driven runs: ``benchmarks/steps.py``'s happy run (four steps, then ``finish()``), driven from
  threads, K in flight, one prefork tool worker (``benchmarks.bench_app``);
- hosted runs: ``benchmarks/agents_app.py``'s ``bench`` agent (three turns of two calls, then a
  final answer; the fake model answers after ``--model-seconds``), enqueued at once through
  ``saga.client``, a threads turn worker and a prefork tool worker.

Per store shard (every master; for ``single`` the one server), ``INFO cpu`` and ``INFO
commandstats`` before and after a batch of N runs: Redis CPU ms per run (beside it, what the
shard spends idle over as long, read before the batch), commands per run (the benchmark's own
``INFO``, its waits for hosted runs and the replicas' ``REPLCONF`` left out), how many of the
runs the shard hosts (their keys' slot), and the projected ceiling, ``1000 / (CPU ms per
run)`` runs/s: the rate of this mix at which that shard's one core is full. For the cluster,
the busiest shard's ceiling is the cluster's; beside it, the sum over the shards of each one's
ceiling for the runs it hosts (``runs hosted / CPU``), which agrees with it when the load is
even.

Then a second, smaller batch with ``MONITOR`` on every master (a pass of its own: its cost
stays out of the CPU figures): each command's key (an ``EVALSHA``'s first key, the commands a
script runs inside it by their own first key), and the hottest key's share of every store
command seen, per topology: the hottest of all, and the hottest shared by every run (a run's
own keys' share shrinks as the batch grows; a shared key's does not).

Figures are printed, never asserted; the machine's load average is printed at the start and at
the end (a busy neighbour moves runs/s and the ceilings; commands per run it does not move).
The last line: ``shards: driven ceiling single X runs/s, cluster3 Y runs/s (Rx) ...``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import redis  # noqa: E402

TOPOLOGIES = ("single", "cluster3")
PHASES = ("driven", "hosted")
RESULT = "SHARDS-RESULT "
#: Commands left out of a shard's count: the benchmark's own readings, the replicas' acks.
NOT_THE_RUNS = ("info", "replconf", "monitor")
#: Commands that name no key (MONITOR's lines are attributed to a key otherwise).
KEYLESS = frozenset({
    "multi", "exec", "discard", "unwatch", "ping", "info", "select", "client", "cluster",
    "readonly", "readwrite", "hello", "auth", "script", "wait", "waitaof", "time", "command",
    "config", "dbsize", "echo", "role", "monitor", "reset", "quit", "function", "flushdb",
    "flushall", "slowlog", "latency", "debug", "memory", "asking", "replconf", "lastsave",
})  # fmt: skip
_TAG = re.compile(r"\{([^}]*)\}")
_ARG = re.compile(rb'"((?:[^"\\]|\\.)*)"')
_SOURCE = re.compile(rb"^\d+\.\d+ \[\d+ ([^\]]+)\]")


# -- the child: drives one phase against servers the parent owns, and meters it -------------


def read_shard(client: redis.Redis) -> tuple[float, Counter[str]]:
    """CPU seconds of the server so far, and its calls per command (one INFO call)."""
    info = client.info("cpu", "commandstats")
    cpu = float(info["used_cpu_user"]) + float(info["used_cpu_sys"])
    calls: Counter[str] = Counter()
    for name, value in info.items():
        if name.startswith("cmdstat_") and isinstance(value, dict):
            calls[name.removeprefix("cmdstat_")] = int(value["calls"])
    return cpu, calls


class Shards:
    """Plain clients of the store's masters (and replicas, and the broker) for INFO."""

    def __init__(self, masters: list[int], replicas: list[int], broker_url: str) -> None:
        def plain(port: int) -> redis.Redis:
            return redis.Redis(host="127.0.0.1", port=port, socket_timeout=10)

        self.masters = {port: plain(port) for port in masters}
        self.replicas = {port: plain(port) for port in replicas}
        self.broker = redis.Redis.from_url(broker_url, socket_timeout=10)
        self._owner = self._slot_map()

    def _slot_map(self) -> Callable[[str], int]:
        ports = list(self.masters)
        if len(ports) == 1:
            return lambda key: ports[0]
        from redis.crc import key_slot

        slots = self.masters[ports[0]].execute_command("CLUSTER", "SLOTS")
        ranges = [(int(start), int(end), int(master[1])) for start, end, master, *_ in slots]

        def owner(key: str) -> int:
            slot = key_slot(key.encode())
            return next(port for start, end, port in ranges if start <= slot <= end)

        return owner

    def owner_of_run(self, run_id: str) -> int:
        from saga.constants import run_keys

        return self._owner(run_keys(run_id)[0])

    def read(self) -> dict[str, Any]:
        return {
            "masters": {port: read_shard(client) for port, client in self.masters.items()},
            "replicas": sum(read_shard(client)[0] for client in self.replicas.values()),
            "broker": read_shard(self.broker),
        }

    def close(self) -> None:
        for client in [*self.masters.values(), *self.replicas.values(), self.broker]:
            client.close()


def delta(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """CPU seconds and commands (the runs' own) between two readings, per master."""

    def commands(a: Counter[str], b: Counter[str]) -> int:
        return sum(n for name, n in (b - a).items() if name not in NOT_THE_RUNS)

    masters = {}
    for port, (cpu, calls) in after["masters"].items():
        cpu0, calls0 = before["masters"][port]
        masters[port] = {"cpu": cpu - cpu0, "commands": commands(calls0, calls)}
    cpu, calls = after["broker"]
    cpu0, calls0 = before["broker"]
    return {
        "masters": masters,
        "replicas_cpu": after["replicas"] - before["replicas"],
        "broker": {"cpu": cpu - cpu0, "commands": commands(calls0, calls)},
    }


class Monitor:
    """``MONITOR`` on one server in a thread: its raw lines, until stopped (bounded)."""

    def __init__(self, port: int, limit: float) -> None:
        self.port = port
        self.lines: list[bytes] = []
        self.ready = threading.Event()
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._deadline = time.monotonic() + limit
        self._thread = threading.Thread(target=self._run, name=f"monitor-{port}", daemon=True)

    def start(self) -> Monitor:
        self._thread.start()
        return self

    def _run(self) -> None:
        conn = redis.Connection(host="127.0.0.1", port=self.port, socket_timeout=10)
        try:
            conn.connect()
            conn.send_command("MONITOR")
            conn.read_response()
            self.ready.set()
            # Once stopped, what is still on its way is drained: until 0.5 s of silence, 5 s
            # at most (another client may never fall silent).
            quiet_since: float | None = None
            drain_until: float | None = None
            while time.monotonic() < min(self._deadline, drain_until or self._deadline):
                if conn.can_read(timeout=0.2):
                    reply = conn.read_response()
                    self.lines.append(reply if isinstance(reply, bytes) else str(reply).encode())
                    quiet_since = None
                elif self._stop.is_set():
                    quiet_since = quiet_since or time.monotonic()
                    if time.monotonic() - quiet_since > 0.5:
                        break
                if self._stop.is_set() and drain_until is None:
                    drain_until = time.monotonic() + 5.0
        except BaseException as exc:  # reported by the caller
            self.error = exc
            self.ready.set()
        finally:
            conn.disconnect()

    def stop(self, timeout: float = 15.0) -> None:
        self._stop.set()
        self._thread.join(timeout)


def key_of(args: list[bytes]) -> str | None:
    """The key a command touches (an EVAL's first key), None for a command that names none."""
    name = args[0].decode(errors="replace").lower()
    if name in KEYLESS:
        return None
    if name in ("eval", "evalsha", "eval_ro", "evalsha_ro", "fcall", "fcall_ro"):
        if len(args) > 3 and args[2].isdigit() and int(args[2]) > 0:
            return args[3].decode(errors="replace")
        return None
    return args[1].decode(errors="replace") if len(args) > 1 else None


def tally(monitors: list[Monitor], run_ids: set[str]) -> dict[str, Any]:
    """Every command each master saw, by key: all of them (a script's inner commands too, as
    ``commandstats`` counts them) and those clients sent. A key tagged with one of ``run_ids``
    is one run's (its share shrinks as more runs share the store); the hottest of the others,
    shared by every run, is reported apart (its share does not)."""
    every: Counter[str] = Counter()
    sent: Counter[str] = Counter()
    where: dict[str, int] = {}
    per_master: Counter[int] = Counter()
    total = total_sent = 0
    for monitor in monitors:
        for line in monitor.lines:
            source = _SOURCE.match(line)
            args = [arg.replace(b'\\"', b'"') for arg in _ARG.findall(line)]
            if source is None or not args:
                continue
            inner = source.group(1) == b"lua"
            if args[0].lower() in (b"info", b"monitor", b"replconf"):
                continue
            total += 1
            total_sent += not inner
            per_master[monitor.port] += 1
            key = key_of(args)
            if key is None:
                continue
            every[key] += 1
            sent[key] += not inner
            where[key] = monitor.port

    def one_run(key: str) -> bool:
        tag = _TAG.search(key)
        return tag is not None and tag.group(1) in run_ids

    top = [(key, n, sent[key], where[key]) for key, n in every.most_common(5)]
    shared = [(k, n, sent[k], where[k]) for k, n in every.most_common() if not one_run(k)][:3]
    top_sent = [(key, n, where[key]) for key, n in sent.most_common(1)]
    return {
        "total": total,
        "sent": total_sent,
        "top": top,
        "shared": shared,
        "top_sent": top_sent,
        "per_master": {port: per_master[port] for port in (m.port for m in monitors)},
    }


def drive_batch(phase: str, runs: int, inflight: int, timeout: float) -> Callable[[int], list[str]]:
    """A function that plays ``n`` runs of ``phase`` and returns their ids (the hosted one
    also counts the benchmark's own polls of the store, in ``drive.polls``)."""
    if phase == "driven":
        from benchmarks import bench_app, steps

        saga = bench_app.saga

        def driven(n: int) -> list[str]:
            with ThreadPoolExecutor(max_workers=inflight) as pool:
                pictures = pool.map(lambda i: steps.drive_saga(saga, i, False, timeout), range(n))
                return [picture.run_id for picture in pictures]

        return driven

    from benchmarks import agents_app
    from saga.client import Client
    from saga.constants import run_keys

    client = Client(
        broker_url=os.environ["SAGA_BROKER_URL"], redis_url=os.environ["SAGA_REDIS_URL"]
    )
    store = client.store.client
    polls: Counter[str] = Counter()

    def hosted(n: int) -> list[str]:
        start = time.monotonic()
        with ThreadPoolExecutor(max_workers=8) as pool:
            ids = list(
                pool.map(lambda i: client.enqueue_run(agents_app.AGENT, f"bench {i}"), range(n))
            )
        # One run at a time, in enqueue order: one read per 50 ms, not a busy poll.
        for run_id in ids:
            while True:
                polls[run_id] += 1
                state, recorded = store.hmget(run_keys(run_id)[0], ["state", "recorded"])
                if state in (b"completed", "completed") and recorded in (b"1", "1"):
                    break
                if state in (b"compensated", b"escalated", "compensated", "escalated"):
                    raise RuntimeError(f"hosted run {run_id} ended {state!r}")
                if time.monotonic() - start > timeout:
                    raise TimeoutError(f"hosted run {run_id} still {state!r} after {timeout} s")
                time.sleep(0.05)
        return ids

    hosted.polls = polls  # type: ignore[attr-defined]
    return hosted


def child(args: argparse.Namespace) -> int:
    """One phase against the servers the parent started: warm up, meter a batch, MONITOR a
    smaller one; prints one ``SHARDS-RESULT {json}`` line."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    from saga.settings import Settings

    masters = [int(p) for p in args.masters.split(",")]
    replicas = [int(p) for p in args.replicas_ports.split(",") if p]
    shards = Shards(masters, replicas, os.environ["SAGA_BROKER_URL"])
    try:
        drive = drive_batch(args.child, args.runs, args.inflight, args.timeout)
        drive(args.inflight if args.child == "driven" else 5)  # imports, connections, scripts
        idle0 = shards.read()
        time.sleep(args.idle)
        idle = delta(idle0, shards.read())
        polls: Counter[str] = getattr(drive, "polls", Counter())
        polls.clear()
        before = shards.read()
        start = time.perf_counter()
        ids = drive(args.runs)
        seconds = time.perf_counter() - start
        metered = delta(before, shards.read())
        hosted = Counter(shards.owner_of_run(run_id) for run_id in ids)
        own = Counter()
        for run_id, n in polls.items():
            own[shards.owner_of_run(run_id)] += n
        for port, row in metered["masters"].items():
            row["idle_cpu_per_s"] = idle["masters"][port]["cpu"] / args.idle
            row["hosted"] = hosted[port]
            row["commands"] -= own[port]  # the benchmark's own waits, not the runs'
            row["own_polls"] = own[port]
        monitors = [Monitor(port, args.timeout).start() for port in masters]
        try:
            deadline = time.monotonic() + 10
            for monitor in monitors:
                monitor.ready.wait(max(0.0, deadline - time.monotonic()))
                if monitor.error is not None or not monitor.ready.is_set():
                    raise RuntimeError(f"MONITOR on {monitor.port} failed: {monitor.error}")
            watched = drive(args.monitor_runs)
        finally:
            for monitor in monitors:
                monitor.stop()
        keys = tally(monitors, set(watched))
        keys["own_polls"] = sum(polls[run_id] for run_id in watched)
        keys["runs"] = args.monitor_runs
    finally:
        shards.close()
    result = {
        "phase": args.child,
        "runs": args.runs,
        "inflight": args.inflight,
        "replicas": len(replicas),
        "seconds": seconds,
        "index_shards": Settings.from_env().index_layout().shards,
        "metered": metered,
        "keys": keys,
    }
    print(RESULT + json.dumps(result), flush=True)
    return 0


# -- the parent: starts and stops every server and worker, runs the children, prints -------


class Store:
    """The store of one topology: its servers, its URL, its masters and replicas by port."""

    def __init__(self, topology: str, directory: Path, replicas: int) -> None:
        from saga.testing import RedisServer

        self.topology = topology
        self.single: Any = None
        self.cluster: Any = None
        if topology == "single":
            self.single = RedisServer("--appendonly", "no", directory=directory / "store")
        elif topology == "cluster3":
            from tests.reliability.redis_cluster import RedisClusterNodes

            self.cluster = RedisClusterNodes(directory / "cluster", 3, replicas)
        else:
            raise ValueError(f"unknown topology {topology!r}: {', '.join(TOPOLOGIES)}")

    def start(self) -> Store:
        (self.single or self.cluster).start()
        return self

    def stop(self) -> None:
        (self.single or self.cluster).stop()

    @property
    def url(self) -> str:
        return str(self.single.url if self.single else self.cluster.url())

    def masters(self) -> list[int]:
        return [self.single.port] if self.single else list(self.cluster.master_ports())

    def replicas(self) -> list[int]:
        if self.single:
            return []
        masters = set(self.masters())
        return [port for port in self.cluster.live_ports() if port not in masters]

    def describe(self) -> str:
        if self.single:
            return "one redis-server"
        each = self.cluster.replicas_each
        replicas = f"{each} replica{'s' * (each > 1)} each" if each else "no replica"
        return f"3 masters, {replicas} ({len(self.cluster.ports)} redis-servers)"


def run_child(
    phase: str, env: dict[str, str], store: Store, args: argparse.Namespace, log: Path
) -> dict[str, Any]:
    """The phase's driver in a process of its own (the apps read their configuration once,
    at import): bounded by ``--timeout``, stopped by PID (SIGTERM, then SIGKILL)."""
    command = [
        sys.executable, str(Path(__file__).resolve()), "--child", phase,
        "--masters", ",".join(map(str, store.masters())),
        "--replicas-ports", ",".join(map(str, store.replicas())),
        "--runs", str(args.runs if phase == "driven" else args.hosted),
        "--inflight", str(args.inflight),
        "--monitor-runs", str(args.monitor_runs if phase == "driven" else args.monitor_hosted),
        "--timeout", str(args.timeout), "--idle", str(args.idle),
    ]  # fmt: skip
    with log.open("w") as stderr:
        process = subprocess.Popen(
            command,
            env={**os.environ, **env},
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=stderr,
            start_new_session=True,
        )
        try:
            out, _ = process.communicate(timeout=args.timeout * 3 + 120)
        finally:
            if process.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGTERM)
                try:
                    process.wait(15)
                except subprocess.TimeoutExpired:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(process.pid, signal.SIGKILL)
                    process.wait(10)
    for line in out.decode(errors="replace").splitlines():
        if line.startswith(RESULT):
            found: dict[str, Any] = json.loads(line.removeprefix(RESULT))
            return found
    raise RuntimeError(
        f"the {phase} driver failed (exit {process.returncode}):\n{log.read_text()[-4000:]}"
    )


def workers_for(phase: str, env: dict[str, str], tmp: Path, args: argparse.Namespace) -> list[Any]:
    from saga.testing import WorkerProcess

    if phase == "driven":
        return [
            WorkerProcess(
                "benchmarks.bench_app", env=env, cwd=ROOT, logfile=tmp / "driven-tools.log"
            )
        ]
    return [
        WorkerProcess(
            "benchmarks.agents_app",
            env=env,
            pool="threads",
            concurrency=args.turn_threads,
            extra_args=["-Q", "saga.turns"],
            cwd=ROOT,
            logfile=tmp / "hosted-turns.log",
        ),
        WorkerProcess(
            "benchmarks.agents_app",
            env=env,
            extra_args=["-Q", "celery"],
            cwd=ROOT,
            logfile=tmp / "hosted-tools.log",
        ),
    ]


def run_topology(topology: str, phases: list[str], args: argparse.Namespace) -> dict[str, Any]:
    """Start the topology's servers, play each phase with workers of its own, stop them all."""
    from benchmarks import costs
    from saga.testing import RedisServer

    tmp = Path(tempfile.mkdtemp(prefix=f"saga-shards-{topology}-"))
    broker = RedisServer("--appendonly", "no", directory=tmp / "broker")
    store = Store(topology, tmp, args.replicas)
    workers: list[Any] = []
    data_dir: Path | None = None
    found: dict[str, Any] = {"describe": store.describe()}
    try:
        broker.start()
        store.start()
        env = costs.bench_environment(f"{broker.url}/0", "saga-shards-", store_url=store.url)
        data_dir = Path(env["SAGA_DEMO_DATA"]).parent
        from tasks import systems

        systems.dispose_engines()
        for phase in phases:
            phase_env = dict(env)
            if phase == "hosted":  # a database of its own on the broker: other apps' queues
                phase_env |= {
                    "SAGA_BROKER_URL": f"{broker.url}/1",
                    "SAGA_RESULT_BACKEND": f"{broker.url}/1",
                    "SAGA_BENCH_COUNTER_URL": f"{broker.url}/1",
                    "SAGA_BENCH_MODEL_SECONDS": str(args.model_seconds),
                }
            print(f"shards: {topology}: {phase} runs, load average {load()}", flush=True)
            workers = workers_for(phase, phase_env, tmp, args)
            try:
                for worker in workers:
                    worker.start(timeout=60)
                found[phase] = run_child(phase, phase_env, store, args, tmp / f"{phase}-driver.log")
            except Exception:
                for worker in workers:
                    print(worker.log()[-2000:], file=sys.stderr)
                raise
            finally:
                for worker in workers:
                    worker.stop()
                workers = []
    finally:
        for worker in workers:
            worker.stop()
        store.stop()
        broker.stop()
        shutil.rmtree(tmp, ignore_errors=True)
        if data_dir is not None:
            shutil.rmtree(data_dir, ignore_errors=True)
    return found


# -- printing --------------------------------------------------------------------------------


def load() -> str:
    return " ".join(f"{value:.2f}" for value in os.getloadavg())


def ceilings(result: dict[str, Any]) -> tuple[float, float]:
    """The busiest shard's ceiling (runs/s of this mix), and the sum over the shards of each
    one's ceiling for the runs it hosts."""
    runs = result["runs"]
    rows = result["metered"]["masters"].values()
    busiest = min(1000 / (1000 * row["cpu"] / runs) if row["cpu"] else float("inf") for row in rows)
    summed = sum(row["hosted"] / row["cpu"] for row in rows if row["cpu"])
    return busiest, summed


def print_phase(phase: str, results: dict[str, dict[str, Any]], args: argparse.Namespace) -> None:
    first = next(r[phase] for r in results.values() if phase in r)
    if phase == "driven":
        what = "benchmarks/steps.py's happy run (4 steps, then finish), driven from threads"
        print(f"\ndriven runs: {what}, {first['runs']} runs, {first['inflight']} in flight")
    else:
        print(
            f"\nhosted runs: benchmarks/agents_app.py's bench agent (3 turns x 2 calls, then the "
            f"answer; model {args.model_seconds:g} s), {first['runs']} enqueued at once"
        )
    print(
        f"  {'topology':<9}{'index':>6}{'runs/s':>8}  {'shard':<8}{'CPU ms/run':>11}"
        f"{'idle ms/run':>12}{'cmds/run':>10}{'runs hosted':>12}{'ceiling runs/s':>16}"
    )
    for topology, found in results.items():
        result = found.get(phase)
        if result is None:
            continue
        runs = result["runs"]
        rate = runs / result["seconds"]
        lead = f"  {topology:<9}{result['index_shards']:>6}{rate:>8.1f}  "
        rows = result["metered"]["masters"]
        total_cpu = total_cmds = 0.0
        for port, row in sorted(rows.items()):
            ms = 1000 * row["cpu"] / runs
            idle = 1000 * row["idle_cpu_per_s"] * result["seconds"] / runs
            total_cpu += ms
            total_cmds += row["commands"] / runs
            ceiling = f"{1000 / ms:.0f}" if ms else "-"
            print(
                f"{lead}{':' + port:<8}{ms:>11.3f}{idle:>12.3f}{row['commands'] / runs:>10.1f}"
                f"{row['hosted']:>12}{ceiling:>16}"
            )
            lead = " " * len(lead)
        if len(rows) > 1:
            busiest, summed = ceilings(result)
            print(
                f"{lead}{'all':<8}{total_cpu:>11.3f}{'':>12}{total_cmds:>10.1f}{runs:>12}"
                f"{busiest:>16.0f}  <- the busiest shard's (sum of each shard's by runs hosted: "
                f"{summed:.0f})"
            )
        meter = result["metered"]
        extra = (
            f"{lead}broker (not the store's): {1000 * meter['broker']['cpu'] / runs:.3f} CPU "
            f"ms/run, {meter['broker']['commands'] / runs:.1f} cmds/run"
        )
        if result["replicas"]:
            replicas = 1000 * meter["replicas_cpu"] / runs
            extra += f"; replicas (in no ceiling): {replicas:.3f} CPU ms/run, all of them"
        polls = sum(row["own_polls"] for row in rows.values())
        if polls:
            extra += f"; the benchmark's own waits ({polls / runs:.1f} HMGET/run) left out of cmds"
        print(extra)
    print(
        "  CPU ms/run: the shard's used_cpu_user + used_cpu_sys over the batch / runs; idle "
        "ms/run: what the shard spent idle (measured before the batch) over as long; ceiling: "
        "1000 / CPU ms per run, the mix's runs/s at which that shard's core is full"
    )


def print_keys(results: dict[str, dict[str, Any]]) -> None:
    print(
        "\nhottest key: MONITOR on every master over a smaller batch of its own, after the "
        "metered one; every command by its key (an EVALSHA's first key; a script's own "
        "commands, as commandstats counts them, by theirs). A key of one run's (tagged with its "
        "id) has a share that shrinks as the batch grows; a key shared by every run keeps its "
        "share"
    )
    for topology, found in results.items():
        for phase in PHASES:
            result = found.get(phase)
            if result is None:
                continue
            keys = result["keys"]
            total = keys["total"] or 1

            def share(row: list[Any], total: int = total) -> str:
                key, n, sent, port = row
                return f"{key} {100 * n / total:.1f}% ({n}, {sent} sent) on :{port}"

            masters = " ".join(f":{port} {n}" for port, n in sorted(keys["per_master"].items()))
            print(
                f"  {topology:<9}{phase:<7} {keys['runs']} runs: {keys['total']} store commands, "
                f"{keys['sent']} sent and {keys['total'] - keys['sent']} inside scripts; "
                f"by master {masters}"
            )
            if keys["top"]:
                print(f"    hottest: {share(keys['top'][0])}")
            if keys["shared"] and keys["shared"][0] != keys["top"][0]:
                print(f"    hottest shared by every run: {share(keys['shared'][0])}")
            if len(keys["top"]) > 1:
                print("    next: " + "; ".join(share(row) for row in keys["top"][1:3]))
            for key, sent, port in keys["top_sent"]:
                part = 100 * sent / (keys["sent"] or 1)
                print(f"    hottest among sent commands: {key} {part:.1f}% of sent on :{port}")
            if keys.get("own_polls"):
                print(
                    f"    (the benchmark's own waits are in these: {keys['own_polls']} HMGET of "
                    "the runs' :run keys)"
                )


def summary(results: dict[str, dict[str, Any]]) -> str:
    parts = []
    for phase in PHASES:
        cells = []
        for topology, found in results.items():
            if phase in found:
                cells.append((topology, ceilings(found[phase])[0]))
        if not cells:
            continue
        text = ", ".join(f"{topology} {value:.0f} runs/s" for topology, value in cells)
        if len(cells) > 1 and cells[0][1]:
            text += f" ({cells[-1][1] / cells[0][1]:.2f}x)"
        parts.append(f"{phase} ceiling {text}")
    hottest, shared = [], []
    for topology, found in results.items():
        keys = found.get("driven", found.get("hosted", {})).get("keys")
        if keys and keys["top"]:
            hottest.append(f"{topology} {100 * keys['top'][0][1] / (keys['total'] or 1):.1f}%")
        if keys and keys["shared"]:
            key, n, *_ = keys["shared"][0]
            shared.append(f"{topology} {key} {100 * n / (keys['total'] or 1):.1f}%")
    if hottest:
        parts.append("hottest key " + ", ".join(hottest))
    if shared:
        parts.append("hottest shared key " + ", ".join(shared))
    return "shards: " + "; ".join(parts)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--topology", default="single,cluster3", help="comma-separated: single, cluster3"
    )
    parser.add_argument("--phases", default="driven,hosted", help="comma-separated: driven, hosted")
    parser.add_argument("--runs", type=int, default=300, help="driven runs metered per topology")
    parser.add_argument("--inflight", type=int, default=8, help="driven runs at once")
    parser.add_argument(
        "--hosted", type=int, default=100, help="hosted runs metered (enqueued at once)"
    )
    parser.add_argument("--monitor-runs", type=int, default=40, help="driven runs under MONITOR")
    parser.add_argument("--monitor-hosted", type=int, default=20, help="hosted runs under MONITOR")
    parser.add_argument("--model-seconds", type=float, default=0.1, help="the fake model's wait")
    parser.add_argument("--turn-threads", type=int, default=50, help="the turn worker's threads")
    parser.add_argument("--replicas", type=int, default=1, help="replicas per cluster master")
    parser.add_argument("--idle", type=float, default=2.0, help="seconds of idle reading")
    parser.add_argument("--timeout", type=float, default=600.0, help="longest batch, seconds")
    parser.add_argument("--child", choices=PHASES, help=argparse.SUPPRESS)
    parser.add_argument("--masters", default="", help=argparse.SUPPRESS)
    parser.add_argument("--replicas-ports", default="", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        return child(args)
    topologies = [t.strip() for t in args.topology.split(",") if t.strip()]
    phases = [p.strip() for p in args.phases.split(",") if p.strip()]
    if not topologies or any(t not in TOPOLOGIES for t in topologies):
        parser.error(f"--topology: one or more of {', '.join(TOPOLOGIES)}")
    if not phases or any(p not in PHASES for p in phases):
        parser.error(f"--phases: one or more of {', '.join(PHASES)}")
    if min(args.runs, args.inflight, args.hosted, args.monitor_runs, args.monitor_hosted) < 1:
        parser.error("every count must be at least 1")

    print(f"shards: load average {load()} at the start ({os.cpu_count()} CPUs)")
    results: dict[str, dict[str, Any]] = {}
    for topology in topologies:
        results[topology] = run_topology(topology, phases, args)
    for topology, found in results.items():
        print(
            f"  {topology}: the store on {found['describe']}; the broker and the results on a "
            "redis-server of their own"
        )
    for phase in phases:
        print_phase(phase, results, args)
    print_keys(results)
    print(f"\nshards: load average {load()} at the end")
    print(summary(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
