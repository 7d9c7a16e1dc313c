"""What a run costs, measured the way that survives a noisy machine: CPU seconds per process
(from ``/proc``, so a busy neighbour slows a run down without adding to its CPU) and Redis
commands (``INFO commandstats``: every command, including those a Lua script runs).

Shared by ``benchmarks/peers.py`` and ``benchmarks/scale.py``.
"""

from __future__ import annotations

import os
import resource
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis

_TICKS = os.sysconf("SC_CLK_TCK")


def _stat_times(pid: int) -> list[float]:
    """utime, stime, cutime, cstime of ``pid`` in seconds (fields 14-17 of its stat, 11-14
    after the name)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return [int(v) / _TICKS for v in fields[11:15]]


def process_cpu(pid: int, descendants: bool = True) -> float:
    """CPU seconds (user + system) of ``pid`` and every live descendant, plus what its
    reaped children used (``descendants=False``: of ``pid`` alone); 0 for a process that is
    gone."""
    total = 0.0
    for one in [pid, *descendants_of(pid)] if descendants else [pid]:
        try:
            times = _stat_times(one)
        except (FileNotFoundError, ProcessLookupError, IndexError):
            continue
        total += sum(times if descendants else times[:2])
    return total


def user_and_system(pid: int) -> tuple[float, float]:
    """CPU seconds of one process, all its threads, in user space and in the kernel."""
    user, system, _, _ = _stat_times(pid)
    return user, system


def strace_row(strace_summary: str, name: str) -> tuple[int, int]:
    """The calls and microseconds per call of ``name`` (a system call, or ``total``) in
    ``strace -c``'s table; (0, 0) if the table has no such row."""
    for line in strace_summary.splitlines():
        cells = line.split()
        if cells and cells[-1] == name:
            return int(cells[3]), int(cells[2])
    return 0, 0


def descendants_of(pid: int) -> list[int]:
    found: list[int] = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except FileNotFoundError:
        return found
    for tid in tasks:
        try:
            children = Path(f"/proc/{pid}/task/{tid}/children").read_text().split()
        except FileNotFoundError:
            continue
        for child in children:
            found.append(int(child))
            found.extend(descendants_of(int(child)))
    return found


def own_cpu() -> float:
    """This process's CPU seconds, all threads (the caller's share)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def redis_cpu(client: redis.Redis) -> float:
    info = client.info("cpu")
    return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])


def redis_commands(client: redis.Redis) -> dict[str, int]:
    """Calls per command since the server's stats were reset (``cmdstat_`` prefix dropped)."""
    stats = client.info("commandstats")
    return {name.removeprefix("cmdstat_"): int(v["calls"]) for name, v in stats.items()}


def total_commands(client: redis.Redis) -> int:
    return sum(redis_commands(client).values())


@dataclass
class Meter:
    """CPU of the named processes and Redis's, and Redis commands, between start and stop."""

    client: redis.Redis
    pids: dict[str, int]
    #: Extra CPU readers by name (PostgreSQL's backends, a subprocess's own report).
    readers: dict[str, Any] = field(default_factory=dict)
    _start: dict[str, float] = field(default_factory=dict)
    _commands: int = 0

    def _read(self) -> dict[str, float]:
        values = {"caller": own_cpu(), "redis": redis_cpu(self.client)}
        values.update({name: process_cpu(pid) for name, pid in self.pids.items()})
        values.update({name: float(read()) for name, read in self.readers.items()})
        return values

    def start(self) -> None:
        self._start = self._read()
        self._commands = total_commands(self.client)

    def stop(self) -> tuple[dict[str, float], int]:
        """CPU seconds by process, and Redis commands, since ``start`` (the INFO calls the
        meter itself sends are taken off)."""
        end = self._read()
        commands = total_commands(self.client) - self._commands - 3
        return {k: end[k] - self._start[k] for k in end}, commands


def bench_environment(redis_url: str, prefix: str, store_url: str = "") -> dict[str, str]:
    """A private Redis for broker, results and stack (``store_url``: the stack's, if it
    differs), throwaway systems and records; set in this process (before the apps read their
    configuration) and given to the worker. The three systems are reset."""
    root = Path(__file__).resolve().parents[1]
    tmp = Path(tempfile.mkdtemp(prefix=prefix))
    env = {
        "SAGA_REDIS_URL": store_url or redis_url,
        "SAGA_BROKER_URL": redis_url,
        "SAGA_RESULT_BACKEND": redis_url,
        "SAGA_DEMO_DATA": str(tmp / "data"),
        "SAGA_DATABASE_URL": f"sqlite:///{tmp / 'records.db'}",
        "PYTHONPATH": str(root),
    }
    os.environ.update(env)
    from tasks import systems

    systems.reset()
    return env
