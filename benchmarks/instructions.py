"""Instructions per run, counted by valgrind's callgrind in every process a run touches: the
one reading of a run's cost that does not move with this machine.

CPU seconds per run, which the targets are stated in, drift by a third between invocations a
minute apart here (``docs/performance.md``), so a cut of a few percent cannot be seen in them.
Instructions executed can: callgrind counts them exactly, and the same code doing the same work
executes the same number within a fraction of a percent, whatever else the machine does.

Each process is run under callgrind: the caller (a driver subprocess of this script, driving
the runs as ``benchmarks/peers.py`` does), the Celery worker (prefork, one pool process, as
``benchmarks.instructions_app``: the benchmark app with a task that reaches the pool process's
counters) and the store's ``redis-server``. Every mode warms up first (imports, connections,
scripts, pages); then every process's counters are zeroed, the measured runs go one at a time,
and every process dumps what it executed since. The servers' instructions with no run at all
(the worker's timers and event heartbeats, Redis's cron, the zeroing and dumping themselves)
are counted as well, over as long a span, and taken off.

What it does not count: the kernel's work (system calls, the disk), and time spent waiting.
It counts the user-space work saga's code can change; ``benchmarks/peers.py`` gives the
seconds. Under callgrind everything runs 30-50 times slower, so timeouts are long, runs go
one at a time, and a measured mode of 20 runs takes a minute or two. Needs valgrind and a C
compiler (Debian: ``apt-get install valgrind gcc``) and the right to trace a child (root, or
``kernel.yama.ptrace_scope`` 0) for ``callgrind_control``.

    python benchmarks/instructions.py [--runs N] [--warm N] [--repeat N] [--keep DIR]
    python benchmarks/instructions.py --seconds [--runs N] [--repeat N]

With ``--keep DIR`` callgrind's files stay in DIR, one per process and dump
(``PID.out.N``), for ``callgrind_annotate`` to say which functions the instructions went to.

``--seconds`` runs the same modes without callgrind, one run at a time, on a worker and Redis
of its own, and prints what the instructions leave out: each process's CPU milliseconds per run,
user and system apart (``/proc``), and its system calls per run (``strace -c``, where
installed). Those runs are the same work as the counted ones; what their seconds add to the
instructions is the kernel's part and the machine's speed per instruction.

The last line: ``instructions saga/bare: happy X fail Y (caller X Y; worker X Y; pool X Y; redis
X Y)`` (``worker``: the worker's main process; ``pool``: its pool process).
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks import costs  # noqa: E402

if TYPE_CHECKING:
    import redis

MODES = ("bare-happy", "saga-happy", "bare-fail", "saga-fail")
PROCESSES = ("caller", "worker", "pool", "redis")
#: Every wait, under a 30-50x slowdown.
TIMEOUT = 600.0
#: The same hash seed everywhere: dict and set layouts, so the counts, repeat.
HASH_SEED = "0"


def callgrind(out_dir: Path) -> list[str]:
    """The command prefix: one output file per process (``%p``), numbered by dump."""
    return [
        "valgrind",
        "--tool=callgrind",
        "--dump-instr=no",
        "--dump-line=no",
        f"--callgrind-out-file={out_dir}/%p.out",
    ]


def control(action: str, pid: int) -> None:
    """``callgrind_control`` on one process; it interrupts the process through vgdb."""
    done = subprocess.run(
        ["callgrind_control", action, str(pid)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    if done.returncode != 0 or "OK" not in done.stdout:
        raise RuntimeError(f"callgrind_control {action} {pid} failed: {done.stdout}{done.stderr}")


def dumped(out_dir: Path, pid: int, before: set[Path], timeout: float = 120.0) -> int:
    """The instructions in the dump ``pid`` wrote after ``before`` was listed."""
    deadline = time.monotonic() + timeout
    while True:
        for path in sorted(set(out_dir.glob(f"{pid}.out.*")) - before):
            for line in path.read_text(errors="replace").splitlines():
                if line.startswith("summary:"):
                    return int(line.split()[1])
        if time.monotonic() > deadline:
            raise TimeoutError(f"process {pid} wrote no callgrind dump within {timeout:.0f} s")
        time.sleep(0.2)


_LIBRARY = """
#include <valgrind/callgrind.h>
void saga_callgrind_zero(void) { CALLGRIND_ZERO_STATS; }
void saga_callgrind_dump(void) { CALLGRIND_DUMP_STATS; }
"""


def client_requests(out_dir: Path) -> Path:
    """The library the pool process calls callgrind's client requests through."""
    source, library = out_dir / "callgrind_requests.c", out_dir / "libsagacallgrind.so"
    source.write_text(_LIBRARY)
    done = subprocess.run(
        ["gcc", "-shared", "-fPIC", "-O2", "-o", str(library), str(source)],
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        raise RuntimeError(
            f"could not build the client-request library (Debian: apt-get install valgrind "
            f"gcc):\n{done.stderr}"
        )
    return library


class Processes:
    """The processes a run touches, each reachable for a zero and a dump: the caller and the
    servers through ``callgrind_control``, the pool process through a task."""

    def __init__(self, out_dir: Path, client: redis.Redis, pids: dict[str, list[int]]) -> None:
        self.out_dir, self.client, self.pids = out_dir, client, pids

    def _pool(self, action: str) -> int:
        """Ask the pool process (the worker's only one) to zero or dump; its process id."""
        from benchmarks import instructions_app

        token = uuid.uuid4().hex
        instructions_app.callgrind.delay(action, token)
        answer = self.client.blpop([instructions_app.ANSWER_PREFIX + token], timeout=TIMEOUT)
        if answer is None:
            raise TimeoutError(f"the pool process did not {action} within {TIMEOUT:.0f} s")
        return int(answer[1])

    def zero(self) -> None:
        self._pool("zero")
        for pid in (pid for group in self.pids.values() for pid in group):
            control("--zero", pid)

    def counts(self) -> dict[str, int]:
        """Dump every process; its instructions since the last zeroing, by name."""
        before = set(self.out_dir.glob("*.out.*"))
        pool = self._pool("dump")
        for pid in (pid for group in self.pids.values() for pid in group):
            control("--dump", pid)
        found = {
            name: sum(dumped(self.out_dir, pid, before) for pid in group)
            for name, group in self.pids.items()
        }
        found["pool"] = dumped(self.out_dir, pool, before)
        return found


class Driver:
    """This script's ``--drive`` mode under callgrind: it warms up, then runs on request."""

    def __init__(self, mode: str, warm: int, runs: int, env: dict[str, str], out: Path) -> None:
        command = [*callgrind(out), sys.executable, __file__, "--drive", mode]
        command += [f"--warm={warm}", f"--runs={runs}"]
        self.log = out / f"driver-{mode}.log"
        with self.log.open("w") as log:
            self.process = subprocess.Popen(
                command,
                env={**os.environ, **env},
                cwd=ROOT,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log,
                text=True,
                start_new_session=True,
            )

    def expect(self, word: str) -> str:
        """The driver's next line, which starts with ``word``; its waits are bounded, and on a
        failure it exits, so the read ends."""
        assert self.process.stdout is not None
        line = self.process.stdout.readline().strip()
        if not line.startswith(word):
            tail = self.log.read_text(errors="replace")[-3000:]
            raise RuntimeError(f"driver said {line!r}, expected {word!r}:\n{tail}")
        return line

    def say(self, word: str) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write(word + "\n")
        self.process.stdin.flush()

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait(30)


def drive(mode: str, warm: int, runs: int) -> int:
    """The driver subprocess: ``warm`` runs, ``ready``; on ``go``, ``runs`` runs one at a time,
    ``done SECONDS``; on ``exit``, leave."""
    import redis

    from benchmarks import peers

    client = redis.Redis.from_url(os.environ["SAGA_REDIS_URL"])
    peers.TIMEOUT = TIMEOUT
    run = peers.celery_drivers(client)[mode]
    for i in range(warm):
        run(i)
    print("ready", flush=True)
    if sys.stdin.readline().strip() != "go":
        return 1
    start = time.monotonic()
    for i in range(runs):
        run(warm + i)
    print(f"done {time.monotonic() - start:.3f}", flush=True)
    sys.stdin.readline()
    return 0


def measure(args: argparse.Namespace) -> list[dict[str, dict[str, float]]]:
    """Every mode ``args.repeat`` times, interleaved: instructions per run by process."""
    import redis

    from saga.testing import RedisServer, WorkerProcess

    out = Path(args.keep or tempfile.mkdtemp(prefix="saga-instructions-"))
    out.mkdir(parents=True, exist_ok=True)
    redis_server = RedisServer("--appendonly", "no", wrapper=callgrind(out))
    os.environ["PYTHONHASHSEED"] = HASH_SEED
    worker: WorkerProcess | None = None
    try:
        redis_server.start(timeout=120)
        env = costs.bench_environment(redis_server.url, "saga-instructions-")
        env["PYTHONHASHSEED"] = HASH_SEED
        env["SAGA_CALLGRIND_LIB"] = os.environ["SAGA_CALLGRIND_LIB"] = str(client_requests(out))
        worker = WorkerProcess(
            "benchmarks.instructions_app",
            env=env,
            concurrency=1,
            cwd=ROOT,
            logfile=out / "worker.log",
            wrapper=callgrind(out),
        )
        worker.start(timeout=TIMEOUT)
        assert redis_server.process is not None
        client = redis.Redis.from_url(redis_server.url)
        readings = []
        for _ in range(args.repeat):
            table: dict[str, dict[str, float]] = {}
            for mode in MODES:
                served = {"worker": [worker.pid], "redis": [redis_server.process.pid]}
                table[mode] = one_mode(mode, args, env, out, client, served)
                print(f"  {mode:<11}{_millions(table[mode])}", flush=True)
            readings.append(table)
        return readings
    except Exception:
        if worker is not None:
            print(worker.log()[-3000:], file=sys.stderr)
        raise
    finally:
        if worker is not None:
            worker.stop()
        redis_server.stop()
        from tasks import systems

        systems.dispose_engines()
        if not args.keep:
            shutil.rmtree(out, ignore_errors=True)


def _millions(row: dict[str, float]) -> str:
    return "  ".join(f"{name} {row[name] / 1e6:.2f}M" for name in (*PROCESSES, "idle"))


def one_mode(
    mode: str,
    args: argparse.Namespace,
    env: dict[str, str],
    out: Path,
    client: redis.Redis,
    served: dict[str, list[int]],
) -> dict[str, float]:
    """One mode's instructions per run by process, the servers' idle share taken off."""
    driver = Driver(mode, args.warm, args.runs, env, out)
    try:
        driver.expect("ready")
        running = Processes(out, client, {"caller": [driver.process.pid], **served})
        running.zero()
        driver.say("go")
        seconds = float(driver.expect("done").split()[1])
        busy = running.counts()
        driver.say("exit")
        driver.process.wait(TIMEOUT)
    finally:
        driver.stop()
    # The servers idle for as long, counted the same way: what they do with no run at all.
    idling = Processes(out, client, served)
    idling.zero()
    time.sleep(seconds)
    idle = idling.counts()
    row = {"caller": busy["caller"] / args.runs}
    for name in (*served, "pool"):
        row[name] = max(busy[name] - idle[name], 0) / args.runs
    row["idle"] = sum(idle.values()) / args.runs
    row["total"] = sum(row[name] for name in PROCESSES)
    return row


def seconds(args: argparse.Namespace) -> None:
    """``--seconds``: the modes without callgrind, one run at a time; CPU ms per run by
    process (user/system), then system calls per run by process."""
    import redis

    from benchmarks import peers
    from saga.testing import RedisServer, WorkerProcess

    server = RedisServer("--appendonly", "no").start()
    env = costs.bench_environment(server.url, "saga-seconds-")
    worker = WorkerProcess("benchmarks.bench_app", env=env, concurrency=1, cwd=ROOT)
    client = redis.Redis.from_url(server.url)
    try:
        worker.start()
        assert server.process is not None
        pool = costs.descendants_of(worker.pid)
        pids = {"caller": os.getpid(), "worker": worker.pid, "pool": pool[0]}
        pids["redis"] = server.process.pid
        drivers = peers.celery_drivers(client)
        for mode in MODES:  # imports, connections, scripts, pages
            for i in range(args.warm * 4):
                drivers[mode](i)
        for _ in range(args.repeat):
            totals = {}
            for mode in MODES:
                before = {name: costs.user_and_system(pid) for name, pid in pids.items()}
                for i in range(args.runs):
                    drivers[mode](i)
                after = {name: costs.user_and_system(pid) for name, pid in pids.items()}
                cells = []
                for name in pids:
                    user = (after[name][0] - before[name][0]) * 1000 / args.runs
                    system = (after[name][1] - before[name][1]) * 1000 / args.runs
                    totals[mode] = totals.get(mode, 0.0) + user + system
                    cells.append(f"{name} {user:.2f}/{system:.2f}")
                print(f"  {mode:<11}cpu ms user/system: {'  '.join(cells)}", flush=True)
            print(
                f"cpu saga/bare: happy {totals['saga-happy'] / totals['bare-happy']:.2f} "
                f"fail {totals['saga-fail'] / totals['bare-fail']:.2f}",
                flush=True,
            )
        if shutil.which("strace") is None:
            print("system calls: strace is not installed (Debian: apt-get install strace)")
            return
        for mode in MODES:
            outputs = {name: Path(tempfile.mkstemp(suffix=".strace")[1]) for name in pids}
            tracers = [
                subprocess.Popen(
                    ["strace", "-c", "-q", "-o", str(outputs[name]), "-p", str(pid)],
                    stderr=subprocess.DEVNULL,
                )
                for name, pid in pids.items()
            ]
            time.sleep(1.0)  # attached
            for i in range(args.runs):
                drivers[mode](i)
            time.sleep(0.5)  # the last run's replies read
            for tracer in tracers:
                tracer.send_signal(signal.SIGINT)
                tracer.wait(30)
            cells = [
                f"{name} {costs.strace_row(path.read_text(), 'total')[0] / args.runs:.1f}"
                for name, path in outputs.items()
            ]
            for path in outputs.values():
                path.unlink()
            print(f"  {mode:<11}system calls per run: {'  '.join(cells)}", flush=True)
    finally:
        worker.stop()
        client.close()
        server.stop()
        from tasks import systems

        systems.dispose_engines()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, help="measured runs per mode (20; with --seconds, 100)")
    parser.add_argument("--warm", type=int, default=5, help="warm-up runs per mode")
    parser.add_argument("--repeat", type=int, default=2, help="readings of every mode")
    parser.add_argument(
        "--keep", metavar="DIR", help="leave callgrind's files in DIR, for callgrind_annotate"
    )
    parser.add_argument(
        "--seconds",
        action="store_true",
        help="the same runs without callgrind: CPU ms (user/system) and system calls per run",
    )
    parser.add_argument("--drive", choices=MODES, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.drive:
        return drive(args.drive, args.warm, args.runs)
    args.runs = args.runs or (100 if args.seconds else 20)
    if args.seconds:
        print(
            f"the same modes without callgrind, {args.runs} runs one at a time per reading; "
            "per run, by process"
        )
        seconds(args)
        return 0
    for tool in ("valgrind", "callgrind_control", "gcc"):
        if shutil.which(tool) is None:
            parser.error(f"{tool} is not installed (Debian: apt-get install valgrind gcc)")
    print(
        f"instructions per run (millions), {args.runs} runs one at a time per mode after "
        f"{args.warm} to warm up, {args.repeat} readings interleaved; the servers' idle "
        "instructions over the same span taken off (idle: what was taken off, per run)"
    )
    readings = measure(args)

    def ratio(path: str, name: str) -> float:
        return statistics.median(
            table[f"saga-{path}"][name] / table[f"bare-{path}"][name] for table in readings
        )

    for path in ("happy", "fail"):
        spread = [t[f"saga-{path}"]["total"] / t[f"bare-{path}"]["total"] for t in readings]
        print(f"{path}: saga/bare per reading " + ", ".join(f"{r:.3f}" for r in spread))
    print(
        f"instructions saga/bare: happy {ratio('happy', 'total'):.3f} "
        f"fail {ratio('fail', 'total'):.3f} ("
        + "; ".join(
            f"{name} {ratio('happy', name):.2f} {ratio('fail', name):.2f}" for name in PROCESSES
        )
        + ")"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
