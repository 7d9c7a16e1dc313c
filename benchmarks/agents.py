"""Hosted agent runs under load: do model waits overlap, and what does hosting cost?

N runs (default 200) of the ``bench`` agent (``benchmarks.agents_app``) are enqueued at once
through ``saga.client``, from a few threads as a web app's requests would arrive. The fake
model answers after 0.5 s; each run has 3 turns of 2 tool calls, then a final answer (4 model
calls, 6 steps). The benchmark starts its own workers, as production runs them: threads-pool
turn workers (``-Q saga.turns``, 50 threads each as the README runs them, enough of them for
one thread per run, so every run's model call can wait at once) and a prefork tool worker.

The same work is then driven from this process, as an agent loop in a web app would drive it:
N threads, each sleeping 0.5 s per model call and calling ``run.call(...).result()`` on the
same tools through the same tool worker, then ``run.finish()``. Modes alternate round by round
so drift hits both alike.

The last line, ``agent runs: N runs, peak M model calls in flight, X runs/s, hosted/driven
ratio R``, gives the hosted figures (median over rounds). Targets: M >= 0.9 N (model calls
overlap: no turn waits for a slot while another thinks) and R >= 0.8 (hosting costs at most a
fifth of the throughput). The CPU seconds each mode spent per run (workers and this process)
are printed too: on a busy machine the rates mostly measure the neighbours, that does not.
The line before the last prices what no loop can save: a no-op task with a turn's options, sent
to the turn workers N at a time, costs Celery so much CPU per message; a hosted run
needs four (a turn is one task), so a machine whose CPU is the limit cannot give a ratio above
``driven / (driven + 4 x that)`` even were the loop itself free.
Figures are reported, never asserted: the exit status is non-zero only if a run did not
complete or a wait timed out.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import redis

ROOT = Path(__file__).resolve().parents[1]
#: The Redis database index this benchmark owns: flushed before and after.
BENCH_DB = int(os.environ.get("SAGA_BENCH_AGENTS_REDIS_DB", "11"))
APP = "benchmarks.agents_app"
ENDED = ("completed", "compensated", "escalated")
#: Threads enqueuing the hosted runs: a web app's requests arrive concurrently.
ENQUEUE_THREADS = 8


@dataclass(frozen=True)
class Round:
    rate: float  # runs/s, from the first enqueue (or start) to the last run recorded
    peak: int  # most model calls in flight at once
    cpu: float  # CPU seconds per run: the workers' and this process's
    enqueue: float = 0.0  # seconds the hosted runs' enqueues took
    split: tuple[float, float, float] = (0.0, 0.0, 0.0)  # of cpu: turn workers, tools, caller
    redis: float = 0.0  # the Redis server's CPU seconds per run (not in cpu: it may be remote)


def environment(tmp: Path, runs: int) -> dict[str, str]:
    """Dedicated Redis DB and throwaway records: set here and in every worker.

    The saga store's URL raises its connection pool's cap: redis-py 8 caps a pool at 100
    connections and raises (not waits) past it, and each driving thread holds one while it
    waits for a step (``result()`` blocks on Redis).
    """
    base = os.environ.get("SAGA_REDIS_URL", "redis://localhost:6379")
    url = re.sub(r"(/\d+)?/?$", "", base, count=1) + f"/{BENCH_DB}"
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    return {
        "SAGA_REDIS_URL": f"{url}?max_connections={max(100, 2 * runs)}",
        "SAGA_BROKER_URL": url,
        "SAGA_RESULT_BACKEND": url,
        "SAGA_DATABASE_URL": f"sqlite:///{tmp / 'records.db'}",
        "PYTHONPATH": path,
    }


def group_cpu(pgids: Sequence[int]) -> dict[int, float]:
    """CPU seconds used so far by the live processes of each of these process groups (Linux
    /proc; 0 elsewhere). The workers' pool processes live as long as the benchmark, so none
    of their time is lost to an exit."""
    ticks = dict.fromkeys(pgids, 0)
    for entry in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = entry.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) in ticks:  # pgrp; then utime and stime, in clock ticks
            ticks[int(fields[2])] += int(fields[11]) + int(fields[12])
    return {pgid: n / os.sysconf("SC_CLK_TCK") for pgid, n in ticks.items()}


def own_cpu() -> float:
    times = os.times()
    return times.user + times.system


class Bench:
    """One mode's round: N runs, timed from the first enqueue to the last run recorded."""

    def __init__(
        self, env: dict[str, str], turn_pgids: Sequence[int], tool_pgid: int, timeout: float
    ) -> None:
        from benchmarks import agents_app
        from saga.client import Client

        self.app = agents_app
        self.client = Client(broker_url=env["SAGA_BROKER_URL"], redis_url=env["SAGA_REDIS_URL"])
        self.redis = self.client.store.client
        self.turn_pgids = list(turn_pgids)
        self.pgids = [*turn_pgids, tool_pgid]
        self.timeout = timeout

    def close(self) -> None:
        self.app.saga.store.client.close()
        self.client.store.client.close()

    def _cpu(self) -> tuple[float, float, float]:
        """CPU seconds so far: the turn workers', the tool worker's, this process's."""
        groups = group_cpu(self.pgids)
        turns = sum(groups[pgid] for pgid in self.turn_pgids)
        return turns, sum(groups.values()) - turns, own_cpu()

    def _server_cpu(self) -> float:
        """The Redis server's CPU seconds so far (its own figure: the server may be remote)."""
        info = self.redis.info("cpu")
        return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])

    def _begin(self) -> tuple[float, float, float, float]:
        self.redis.delete(self.app.IN_FLIGHT_KEY, self.app.PEAK_KEY)
        return (*self._cpu(), self._server_cpu())

    def _end(
        self,
        runs: int,
        start: float,
        cpu: tuple[float, float, float, float],
        enqueue: float = 0.0,
    ) -> Round:
        rate = runs / (time.perf_counter() - start)
        now = (*self._cpu(), self._server_cpu())
        turns, tools, caller, server = ((b - a) / runs for a, b in zip(cpu, now, strict=True))
        peak = int(self.redis.get(self.app.PEAK_KEY) or 0)
        return Round(rate, peak, turns + tools + caller, enqueue, (turns, tools, caller), server)

    def hosted(self, runs: int) -> Round:
        cpu = self._begin()
        start = time.perf_counter()
        with ThreadPoolExecutor(ENQUEUE_THREADS, thread_name_prefix="enqueue") as pool:
            ids = list(pool.map(self._enqueue, range(runs)))
        enqueue = time.perf_counter() - start
        self._wait_recorded(ids, start)
        done = self._end(runs, start, cpu, enqueue)
        states = {self.client.get_run(run_id).state for run_id in ids}
        if states != {"completed"}:
            raise RuntimeError(f"hosted runs ended {sorted(states)}, not all completed")
        return done

    def _enqueue(self, i: int) -> str:
        return self.client.enqueue_run(self.app.AGENT, f"bench {i}")

    def driven(self, runs: int) -> Round:
        """The same runs driven from one thread each, in this process."""
        cpu = self._begin()
        with ThreadPoolExecutor(max_workers=runs, thread_name_prefix="agent") as pool:
            start = time.perf_counter()
            futures = [pool.submit(self._drive) for _ in range(runs)]
            for future in futures:
                future.result(timeout=self.timeout)
            return self._end(runs, start, cpu)

    def _drive(self) -> None:
        """The hosted run's work, driven here: think, call both tools, wait for both, ..."""
        run = self.app.saga.start_run()
        for _ in range(self.app.TURNS):
            self.app.model_wait()
            handles = [run.call(name, **args) for name, args in self.app.CALLS]
            for handle in handles:
                handle.result(self.timeout)
        self.app.model_wait()  # the final answer
        run.finish(self.timeout)

    def message_cost(self, runs: int, bursts: int) -> tuple[float, float, float]:
        """Celery alone, per turn message: ``bursts`` waves of ``runs`` no-op turns, each wave
        sent at once and taken before the next, as a round's runs move from turn to turn
        together (sent by ``send_turn``, as turns are). CPU seconds per message: this
        process's (the send), the turn workers' (receive, run, ack), the Redis server's."""
        from saga.agents.launch import send_turn
        from saga.constants import TURN_QUEUE

        before = (*self._cpu(), self._server_cpu())
        start = time.perf_counter()
        for wave in range(bursts):
            for i in range(runs):
                send_turn(self.app.app, f"{wave:016x}{i:016x}", 1, task=self.app.NOOP_TURN)
            # Taken once the queue is empty and nothing is left unacknowledged (kombu's hash).
            while self.redis.llen(TURN_QUEUE) or self.redis.hlen("unacked"):
                if time.perf_counter() - start > self.timeout:
                    raise TimeoutError("the no-op turns were not all taken")
                time.sleep(0.02)
        after = (*self._cpu(), self._server_cpu())
        messages = runs * bursts
        turns, _, caller, server = ((b - a) / messages for a, b in zip(before, after, strict=True))
        return caller, turns, server

    def _wait_recorded(self, ids: list[str], start: float) -> None:
        """Until every run has ended and its record is written (what ``run.finish`` waits
        for on the driven side). One run at a time, in enqueue order, so the wait reads Redis
        once per 20 ms instead of competing for the CPU it measures."""
        from saga.constants import run_keys

        for run_id in ids:
            while True:
                state, recorded = self.redis.hmget(run_keys(run_id)[0], ["state", "recorded"])
                if state in ENDED and recorded == "1":
                    break
                if time.perf_counter() - start > self.timeout:
                    raise TimeoutError(f"hosted run {run_id} still {state} after {self.timeout} s")
                time.sleep(0.02)


def measure(args: argparse.Namespace, bench: Bench) -> tuple[Round, float]:
    """Warm up, alternate rounds, print the table; return the hosted medians and the ratio."""
    warm = min(args.runs, 10)
    bench.hosted(warm)  # imports, connections, Lua scripts, the records' tables
    bench.driven(warm)
    rounds: dict[str, list[Round]] = {"hosted": [], "driven": []}
    modes: dict[str, Callable[[int], Round]] = {"hosted": bench.hosted, "driven": bench.driven}
    for _ in range(args.rounds):
        for mode, play in modes.items():
            rounds[mode].append(play(args.runs))
    print(
        f"{args.rounds} rounds per mode of {args.runs} runs (3 turns x 2 calls, then a final "
        f"answer; model {bench.app.MODEL_SECONDS:.1f} s); {args.turn_workers} turn worker(s) "
        f"-P threads -c {args.turn_threads}, tool worker prefork -c {args.tool_concurrency}"
    )

    def column(rows: list[Round], value: Callable[[Round], Any], spec: str) -> str:
        return " ".join(format(value(row), spec) for row in rows)

    print(
        f"{'mode':<8}{'runs/s':>18}{'peak in flight':>18}{'CPU s/run':>18}{'enqueue s':>18}"
        f"{'CPU turns/tools/caller':>26}{'Redis CPU':>12}"
    )
    for mode, rows in rounds.items():
        enqueue = column(rows, lambda r: r.enqueue, ".2f") if mode == "hosted" else "-"
        medians = (statistics.median(r.split[k] for r in rows) for k in range(3))
        split = "/".join(format(m, ".3f") for m in medians)
        server = statistics.median(r.redis for r in rows)
        print(
            f"{mode:<8}{column(rows, lambda r: r.rate, '.1f'):>18}"
            f"{column(rows, lambda r: r.peak, 'd'):>18}"
            f"{column(rows, lambda r: r.cpu, '.3f'):>18}{enqueue:>18}{split:>26}{server:>12.3f}"
        )
    print(
        "each round's figure; runs/s from the first enqueue to the last run recorded; peak: "
        "most fake model calls sleeping at once; CPU split and Redis CPU: medians, seconds per "
        "run; targets: peak >= 0.9 N, ratio within 0.08 of the ceiling below"
    )

    def median(mode: str, value: Callable[[Round], float]) -> float:
        return statistics.median(value(row) for row in rounds[mode])

    hosted = Round(
        median("hosted", lambda r: r.rate),
        round(median("hosted", lambda r: r.peak)),
        median("hosted", lambda r: r.cpu),
    )
    messages_per_run = bench.app.TURNS + 1
    send, receive, server = bench.message_cost(args.runs, messages_per_run)
    per_message = send + receive + server
    driven = median("driven", lambda r: r.cpu + r.redis)
    floor = messages_per_run * per_message
    print(
        f"Celery alone, per turn message (no-op turns, {args.runs} at once): "
        f"{1000 * per_message:.2f} ms CPU (send {1000 * send:.2f}, turn worker "
        f"{1000 * receive:.2f}, Redis {1000 * server:.2f}); a run's {messages_per_run}: "
        f"{floor:.3f} s, {100 * floor / driven:.0f}% of a driven run's {driven:.3f} s "
        f"(workers, caller, Redis). Were the loop itself free, a machine short of CPU would "
        f"give a ratio of at most {driven / (driven + floor):.2f}"
    )
    return hosted, hosted.rate / median("driven", lambda r: r.rate)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=200, help="runs enqueued at once")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds per mode")
    parser.add_argument("--turn-threads", type=int, default=50, help="threads per turn worker")
    parser.add_argument(
        "--turn-workers", type=int, default=0, help="turn workers (default: one thread per run)"
    )
    parser.add_argument("--tool-concurrency", type=int, default=2, help="tool worker processes")
    parser.add_argument("--timeout", type=float, default=300.0, help="longest round, seconds")
    args = parser.parse_args(argv)
    args.turn_threads = min(args.turn_threads, args.runs)
    args.turn_workers = args.turn_workers or math.ceil(args.runs / max(1, args.turn_threads))
    counts = (args.runs, args.rounds, args.turn_threads, args.turn_workers, args.tool_concurrency)
    if min(counts) < 1:
        parser.error("every count must be at least 1")

    with tempfile.TemporaryDirectory(prefix="saga-bench-agents-") as tmp:
        env = environment(Path(tmp), args.runs)
        os.environ.update(env)  # before the app reads its configuration
        sys.path.insert(0, str(ROOT))
        client = redis.Redis.from_url(env["SAGA_BROKER_URL"], socket_connect_timeout=5)
        client.flushdb()

        from saga.testing import WorkerProcess

        def worker(name: str, pool: str, concurrency: int, queue: str) -> WorkerProcess:
            return WorkerProcess(
                APP,
                env=env,
                pool=pool,
                concurrency=concurrency,
                extra_args=["-Q", queue],
                cwd=ROOT,
                logfile=Path(tmp) / f"{name}.log",
            )

        workers = [
            worker(f"turns-{k}", "threads", args.turn_threads, "saga.turns")
            for k in range(args.turn_workers)
        ]
        workers.append(worker("tools", "prefork", args.tool_concurrency, "celery"))
        bench: Bench | None = None
        try:
            for process in workers:
                process.start()
            bench = Bench(env, [p.pid for p in workers[:-1]], workers[-1].pid, args.timeout)
            hosted, ratio = measure(args, bench)
        except Exception as exc:
            print(f"benchmark failed: {type(exc).__name__}: {exc}", file=sys.stderr)
            for process in workers:
                print(process.log()[-2000:], file=sys.stderr)
            return 1
        finally:
            for process in workers:
                process.stop()
            if bench is not None:
                bench.close()
            client.flushdb()
            client.close()
    print(
        f"agent runs: {args.runs} runs, peak {hosted.peak} model calls in flight, "
        f"{hosted.rate:.1f} runs/s, hosted/driven ratio {ratio:.2f}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
