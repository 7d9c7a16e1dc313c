"""Every Redis command one saga run sends for its own state, in order, with who sends it.

Starts a private redis-server and a worker (``benchmarks.bench_app``), drives two warm-up runs,
then one happy run and one failing run (the fourth step bounces, two undos) under ``MONITOR``.
A command belongs to the run if it names the run (its keys, its signals, its index entry) or
runs inside one of the run's scripts; Celery's own per-message commands (the queue, the unacked
index, the events) are counted apart, since the worker batches them differently under load.

``--markdown`` prints the tables of ``docs/performance.md``; ``--json`` the counts that
``tests/integration/test_command_counts.py`` holds that document to.

``--instructions`` replays the run's own commands, as captured, on a redis-server of its own
under valgrind's callgrind, one command at a time (the run id renamed for each replay), and
prints the instructions Redis executed for each: the least of ``--replays`` replays, less a
window with no command, so a timer that fired in one window does not count. It says what a
script costs Redis beside a plain command, which ``benchmarks/instructions.py`` sums per run.
Needs valgrind (Debian: ``apt-get install valgrind``).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import re
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks import costs  # noqa: E402

#: What follows ``LPUSH`` in a publish to the benchmark's queue (Celery's default).
_QUEUE = ' "celery" '
_LINE = re.compile(
    r'^[\d.]+ \[\d+ (?P<source>lua|[\d.]+:(?P<port>\d+))\] "(?P<command>\w+)"(?P<rest>.*)$'
)


def script_names() -> dict[str, str]:
    """sha1 -> script name, as RunStore loads them."""
    from saga.script_sources import script_sources

    return {
        hashlib.sha1(text.encode()).hexdigest(): name for name, text in script_sources().items()
    }


class Monitor:
    """``MONITOR`` on its own connection, collected in a thread until stopped."""

    def __init__(self, url: str) -> None:
        import redis

        self.connection = redis.Redis.from_url(url).connection_pool.get_connection()
        self.lines: list[str] = []
        self._stop = threading.Event()
        self.connection.send_command("MONITOR")
        self.connection.read_response()
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        while not self._stop.is_set():
            if self.connection.can_read(timeout=0.1):
                self.lines.append(self.connection.read_response().decode(errors="replace"))

    def stop(self) -> list[str]:
        self._stop.set()
        self._thread.join(5)
        self.connection.disconnect()
        return self.lines


def classify(lines: list[str], run_id: str, roles: dict[str, str]) -> dict[str, Any]:
    """The run's own commands in order (who, what, script inside), and Celery's, counted."""
    names = script_names()
    own: list[dict[str, str]] = []
    celery: Counter[str] = Counter()
    inside = ""
    for line in lines:
        match = _LINE.match(line)
        if match is None:
            continue
        command, rest, source = match["command"].upper(), match["rest"], match["source"]
        if source == "lua":
            if command == "LPUSH" and rest.startswith(_QUEUE):
                # A step's message pushed by its reservation, an unwind's by its mark.
                celery[command] += 1
                continue
            if inside:
                own.append({"who": "script", "command": command, "script": inside})
            continue
        inside = ""
        who = roles.get(match["port"] or "", "?")
        if who == "celery" or (command == "LPUSH" and rest.startswith(_QUEUE)):
            # The message's own commands (they name its task id). A step's publish is one
            # of them whoever sends it: Celery's producer, or the caller's store connection
            # pushing the message prepared as Celery's (``saga.prepared_publish``).
            celery[command] += 1
            continue
        if command == "EVALSHA":
            sha = rest.split('"')[1]
            inside = names.get(sha, sha[:8]) if run_id in rest else ""
        if run_id in rest or (command in ("MULTI", "EXEC") and who in ("caller", "worker")):
            script = inside or ""
            # Which index a ZADD writes: the reaper's, or the listing's (by creation time).
            plain = "ZADD created" if command == "ZADD" and ":created" in rest else command
            own.append({"who": who, "command": command, "script": script, "plain": plain})
        elif command not in ("INFO", "CLIENT", "CONFIG"):
            celery[command] += 1
    # A MULTI/EXEC of the store brackets reads of the run: keep only those that do.
    kept = [
        c
        for i, c in enumerate(own)
        if c["command"] not in ("MULTI", "EXEC")
        or (c["command"] == "MULTI" and i + 1 < len(own) and own[i + 1]["command"] != "EXEC")
        or (c["command"] == "EXEC" and i > 0 and own[i - 1]["command"] != "MULTI")
    ]
    return {"commands": kept, "celery": dict(celery)}


def summary(traced: dict[str, Any]) -> dict[str, int]:
    """Counts of one run: its own commands (sent by a client, and run inside its scripts),
    its script calls, and Celery's per-message commands beside them."""
    commands = traced["commands"]
    inside = sum(1 for c in commands if c["who"] == "script")
    return {
        "total": len(commands),
        "sent": len(commands) - inside,
        "scripts": sum(1 for c in commands if c["command"] == "EVALSHA"),
        "in scripts": inside,
        "celery": sum(traced["celery"].values()),
    }


def trace(fail: bool) -> tuple[str, dict[str, Any]]:
    """One run traced: its id, and what ``classify`` makes of the monitor's lines."""
    run_id, lines, roles = monitored(fail)
    return run_id, classify(lines, run_id, roles)


def monitored(fail: bool) -> tuple[str, list[str], dict[str, str]]:
    """One run under ``MONITOR``: its id, the monitor's lines, and who each client is."""
    from benchmarks import bench_app, steps

    url, roles = os.environ["SAGA_REDIS_URL"], current_roles()
    monitor = Monitor(url)
    time.sleep(0.2)
    run = steps.drive_saga(bench_app.saga, 0, fail, 30)
    time.sleep(0.5)  # the worker's last acks and events
    return run.run_id, monitor.stop(), roles


def sent_by_the_run(lines: list[str], roles: dict[str, str]) -> list[list[bytes]]:
    """The commands the caller and the worker sent for the run's own state, whole, in order
    (not Celery's, nor the waits: a replay cannot block)."""
    sent = []
    for line in lines:
        match = _LINE.match(line)
        if match is None or match["source"] == "lua":
            continue
        if roles.get(match["port"] or "", "?") not in ("caller", "worker"):
            continue
        command = [match["command"].encode(), *unquoted(match["rest"])]
        if command[0].upper() not in (b"BLPOP", b"CLIENT", b"INFO", b"CONFIG"):
            sent.append(command)
    return sent


def unquoted(rest: str) -> list[bytes]:
    """``MONITOR``'s arguments, each in double quotes with C escapes (Redis's sdscatrepr)."""
    escapes = {"n": b"\n", "r": b"\r", "t": b"\t", "a": b"\a", "b": b"\b", "\\": b"\\", '"': b'"'}
    args, i = [], 0
    while (i := rest.find('"', i)) >= 0:
        i, arg = i + 1, bytearray()
        while rest[i] != '"':
            if rest[i] != "\\":
                arg += rest[i].encode()
                i += 1
            elif rest[i + 1] == "x":
                arg.append(int(rest[i + 2 : i + 4], 16))
                i += 4
            else:
                arg += escapes[rest[i + 1]]
                i += 2
        args.append(bytes(arg))
        i += 1
    return args


def replay_instructions(
    runs: dict[str, tuple[str, list[list[bytes]]]], replays: int
) -> dict[str, list[tuple[str, int]]]:
    """Each run's commands replayed ``replays`` times on a redis-server under callgrind, the
    run id renamed each time: (label, instructions) per command, the least of its replays
    less the least of twice as many windows with no command. callgrind's files are removed."""
    import shutil
    import tempfile

    import redis

    from benchmarks.instructions import callgrind, control, dumped
    from saga.testing import RedisServer

    names = script_names()
    out = Path(tempfile.mkdtemp(prefix="saga-replay-"))
    server = RedisServer("--appendonly", "no", "--hz", "1", wrapper=callgrind(out))
    server.start(timeout=120)
    assert server.process is not None
    pid = server.process.pid
    client = redis.Redis.from_url(server.url)
    connection = client.connection_pool.get_connection()

    def counted(command: list[bytes] | None) -> int:
        before = set(out.glob(f"{pid}.out.*"))
        control("-z", pid)
        if command is not None:
            connection.send_command(*command, check_health=False)
            # A refusal costs what it costs, and the replay goes on.
            with contextlib.suppress(redis.ResponseError):
                connection.read_response()
        control("-d", pid)
        return dumped(out, pid, before)

    try:
        from saga.script_sources import script_sources

        for text in script_sources().values():
            client.script_load(text)
        idle = min(counted(None) for _ in range(replays * 2))
        table: dict[str, list[tuple[str, int]]] = {}
        for path, (run_id, commands) in runs.items():
            least = [sys.maxsize] * len(commands)
            for replay in range(replays):
                renamed = f"{run_id[:-8]}{replay:04d}{path[:4]}".encode()
                for k, command in enumerate(commands):
                    count = counted([arg.replace(run_id.encode(), renamed) for arg in command])
                    least[k] = min(least[k], count)
            labels = [
                names.get(c[1].decode(), "script") if c[0].upper() == b"EVALSHA" else c[0].decode()
                for c in commands
            ]
            counts = [max(n - idle, 0) for n in least]
            table[path] = list(zip(labels, counts, strict=True))
        return table
    finally:
        connection.disconnect()
        client.close()
        server.stop()
        shutil.rmtree(out, ignore_errors=True)


def current_roles() -> dict[str, str]:
    """Client port -> who (the connections are named by the URLs ``main`` sets)."""
    import redis

    client = redis.Redis.from_url(os.environ["SAGA_BROKER_URL"])
    roles = {}
    for info in client.client_list():
        port = str(info["addr"]).rsplit(":", 1)[1]
        roles[port] = {"saga-caller": "caller", "saga-worker": "worker"}.get(info["name"], "celery")
    return roles


WHY = {
    "create": "the run's hashes, atomically (refuses an existing run id)",
    "reserve": "the pivot gate checked and the step reserved, atomically",
    "begin_step": "check before run: a redelivery replays; the lease is taken",
    "record_success": "record after: result, undo pushed, pivot, settle signal, in one script",
    "record_failure": "the final failure; the last step settling owns the unwind, and its "
    "chain (made from the reading just before) is pushed and marked sent with it",
    "mark_sent": "the unwind's chain pushed (prepared as Celery's) and marked sent, as one: "
    "a redelivered owner must not resend",
    "begin_compensation": "check before run of an undo, fenced by the unwind's owner; lease",
    "record_compensation": "the undo confirmed done: off the stack (the last one: the run "
    "concluded with it, as judged on the reading just before)",
    "conclude": "the run ends once (version-fenced for an unwind)",
    "mark_recorded": "the SQL record is written: now the keys may expire (and the reaper's "
    "index entry moves to after they have)",
}


#: Why a plain command is sent (the reads inside a MULTI are the run's six keys).
WHY_PLAIN = {
    "ZADD": "the reaper's index: due at the deadline",
    "ZADD created": "the listing's index by creation time (NX: a new run only), in the same "
    "round trip",
    "BLPOP": "wait for the settle or end signal: blocking, no polling",
    "HMGET": "the step's outcome (same round trip as the BLPOP), or the run's head (wait)",
    "MULTI": "one transaction: the script in it, if any, then a reading of the whole run (its "
    "six keys)",
}


def markdown(path: str, traced: dict[str, Any]) -> str:
    rows = ["| # | who | command | script (commands inside) | why |", "|---|---|---|---|---|"]
    commands = traced["commands"]
    number = 0
    for i, c in enumerate(commands):
        if c["who"] == "script":
            continue
        number += 1
        script, why = "", WHY_PLAIN.get(c.get("plain", c["command"]), "")
        if c["command"] == "EVALSHA":
            inside = 0
            while i + 1 + inside < len(commands) and commands[i + 1 + inside]["who"] == "script":
                inside += 1
            script, why = f"{c['script']} ({inside})", WHY.get(c["script"], "")
        rows.append(f"| {number} | {c['who']} | {c['command']} | {script} | {why} |")
    counts = summary(traced)
    rows.append("")
    rows.append(
        f"{path}: {counts['total']} commands of its own ({counts['sent']} sent, "
        f"{counts['in scripts']} inside its {counts['scripts']} scripts); Celery's, beside "
        f"them: {counts['celery']}."
    )
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--markdown", action="store_true")
    parser.add_argument(
        "--instructions", action="store_true", help="Redis's instructions per command, replayed"
    )
    parser.add_argument("--replays", type=int, default=3, help="with --instructions")
    args = parser.parse_args(argv)
    from saga.testing import RedisServer, WorkerProcess

    server = RedisServer("--appendonly", "no").start()
    store = f"{server.url}/0?client_name=saga-caller"
    env = costs.bench_environment(server.url, "saga-commands-", store)
    tmp = Path(env["SAGA_DEMO_DATA"]).parent
    worker_env = {**env, "SAGA_REDIS_URL": f"{server.url}/0?client_name=saga-worker"}
    worker = WorkerProcess(
        "benchmarks.bench_app", env=worker_env, cwd=ROOT, logfile=tmp / "worker.log"
    )
    try:
        worker.start()
        for fail in (False, True, False, True):  # warm-up: every script loaded, every pool
            trace(fail)
        if args.instructions:
            captured = {}
            for path, fail in (("happy", False), ("fail", True)):
                run_id, lines, roles = monitored(fail)
                captured[path] = (run_id, sent_by_the_run(lines, roles))
        else:
            results = {"happy": trace(False)[1], "fail": trace(True)[1]}
    finally:
        worker.stop()
        server.stop()
    if args.instructions:
        print_instructions(replay_instructions(captured, args.replays), args.replays)
        return 0
    if args.json:
        print(json.dumps({path: summary(traced) for path, traced in results.items()}))
    elif args.markdown:
        for path, traced in results.items():
            print(markdown(path, traced))
            print()
    else:
        for path, traced in results.items():
            print(path, summary(traced))
    return 0


def print_instructions(table: dict[str, list[tuple[str, int]]], replays: int) -> None:
    print(
        f"Redis's instructions per command of one run (thousands; the least of {replays} "
        "replays, less a window with no command)"
    )
    for path, rows in table.items():
        print(f"{path}:")
        for label, count in rows:
            print(f"  {label:<22}{count / 1000:>8.1f}")
        scripts = [count for label, count in rows if label[0].islower()]
        plain = [count for label, count in rows if not label[0].islower()]
        print(
            f"  {path}: {sum(scripts) / 1e6:.2f} M in {len(scripts)} scripts "
            f"({sum(scripts) / max(len(scripts), 1) / 1000:.0f} k each), "
            f"{sum(plain) / 1e6:.2f} M in {len(plain)} plain commands; "
            f"all {sum(c for _, c in rows) / 1e6:.2f} M"
        )


if __name__ == "__main__":
    sys.exit(main())
