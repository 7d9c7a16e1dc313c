"""Test helpers for saga and for its users' own tools: a real Redis and a real Celery worker,
each started as a subprocess and stopped by PID, with every wait bounded.

Compensations only run when something already broke, so they are exactly the code that needs
tests against a real worker; these helpers make that cheap.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Self

import redis


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _stop_group(process: subprocess.Popen[bytes], timeout: float) -> None:
    """SIGTERM the process group, then SIGKILL what is left after ``timeout``."""
    if process.poll() is not None:
        return
    try:
        os.killpg(process.pid, signal.SIGTERM)
        process.wait(timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait(10)
    except ProcessLookupError:
        pass


class RedisServer:
    """A private ``redis-server`` on a free port, for tests that kill or restart Redis."""

    def __init__(self, *args: str, port: int | None = None, directory: Path | None = None) -> None:
        if shutil.which("redis-server") is None:
            raise RuntimeError(
                "redis-server is not installed (Debian: apt-get install redis-server)"
            )
        self.port = port or free_port()
        self.args = args
        self._own_dir = directory is None
        self.directory = directory or Path(tempfile.mkdtemp(prefix="saga-redis-"))
        self.directory.mkdir(parents=True, exist_ok=True)
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}"

    def start(self, timeout: float = 10.0) -> Self:
        command = ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1"]
        command += ["--save", "", "--dir", str(self.directory), *self.args]
        self.process = subprocess.Popen(
            command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
        )
        client = redis.Redis.from_url(self.url, socket_timeout=1)
        deadline = time.monotonic() + timeout
        try:
            while True:
                try:
                    client.ping()
                    return self
                except redis.ConnectionError as exc:
                    if time.monotonic() > deadline or self.process.poll() is not None:
                        self.stop()
                        raise RuntimeError(f"redis-server on {self.port} did not start") from exc
                    time.sleep(0.05)
        finally:
            client.close()

    def stop(self, timeout: float = 10.0) -> None:
        if self.process is not None:
            _stop_group(self.process, timeout)
            self.process = None
        if self._own_dir:
            shutil.rmtree(self.directory, ignore_errors=True)

    def kill(self) -> None:
        """SIGKILL, keeping the data directory (to restart on the same files)."""
        if self.process is not None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(10)
            self.process = None

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


class WorkerProcess:
    """``celery -A APP worker`` as a subprocess in its own process group.

    ``stop()`` and ``kill()`` act on the whole group, so no pool child outlives a test.
    """

    def __init__(
        self,
        app: str,
        env: Mapping[str, str] | None = None,
        *,
        concurrency: int = 2,
        pool: str = "prefork",
        extra_args: Sequence[str] = (),
        logfile: Path | None = None,
        cwd: Path | None = None,
    ) -> None:
        self.app = app
        self.env = {**os.environ, **(env or {})}
        self.hostname = f"saga-test-{uuid.uuid4().hex[:8]}@%h"
        self.concurrency = concurrency
        self.pool = pool
        self.extra_args = list(extra_args)
        self.logfile = logfile or Path(tempfile.mkstemp(prefix="saga-worker-", suffix=".log")[1])
        self.cwd = cwd
        self.process: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 30.0) -> Self:
        self.logfile.write_text("")
        command = [sys.executable, "-m", "celery", "-A", self.app, "worker"]
        command += ["--loglevel", "INFO", "--logfile", str(self.logfile), "-n", self.hostname]
        command += ["-c", str(self.concurrency), "-P", self.pool, "-E"]
        command += ["--without-gossip", "--without-mingle", *self.extra_args]
        self.process = subprocess.Popen(
            command,
            env=self.env,
            cwd=self.cwd,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        deadline = time.monotonic() + timeout
        while " ready." not in self.log():
            if self.process.poll() is not None or time.monotonic() > deadline:
                tail = self.log()[-2000:]
                self.stop()
                raise RuntimeError(f"celery worker did not become ready:\n{tail}")
            time.sleep(0.05)
        return self

    def log(self) -> str:
        try:
            return self.logfile.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    @property
    def pid(self) -> int:
        if self.process is None:
            raise RuntimeError("worker is not running")
        return self.process.pid

    def stop(self, timeout: float = 20.0) -> None:
        if self.process is not None:
            _stop_group(self.process, timeout)
            self.process = None

    def kill(self) -> None:
        """SIGKILL the worker and its pool children at once, as a crash would."""
        if self.process is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(10)
            self.process = None

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


# -- fault injection --------------------------------------------------------------------------

#: Where a fault can strike in a worker: around a tool's effect or a compensation, and in a
#: hosted turn (``tool`` is then the agent's name after the answer is recorded, and the
#: called tool's name after each call is dispatched), and once an escalation's row is written
#: (``tool`` is then ""), before its notices are.
FAULT_POINTS = (
    "before_effect",
    "after_effect",
    "before_compensation",
    "after_compensation",
    "during_model_call",
    "after_model_answer",
    "between_dispatches",
    "after_loop_ended",
    "after_escalation_recorded",
)
FAULTS_ENV = "SAGA_TESTING_FAULTS"

_HIT = """
local actions = {}
local rules = redis.call('HGETALL', KEYS[1])
for i = 1, #rules, 2 do
  local rule = cjson.decode(rules[i + 1])
  if rule.point == ARGV[1] and (rule.tool == '' or rule.tool == ARGV[2]) then
    local seen = redis.call('HINCRBY', KEYS[2], rules[i], 1)
    if seen >= rule.nth and seen < rule.nth + rule.times then
      table.insert(actions, rules[i + 1])
    end
  end
end
return actions
"""


def faults_enabled() -> bool:
    return os.environ.get(FAULTS_ENV) == "1"


class Faults:
    """Failures injected into real workers, configured through Redis so every worker process
    sees them: fail a tool's Nth call before or after its effect, fail a compensation N
    times, kill the worker at a named point, delay a step.

    It refuses to exist unless ``SAGA_TESTING_FAULTS=1`` is set, in the test and in the
    worker alike, so it cannot be switched on in production by a stray call.
    """

    def __init__(self, client: redis.Redis) -> None:
        from saga.errors import FaultInjectionDisabledError

        if not faults_enabled():
            raise FaultInjectionDisabledError(
                f"fault injection is off: set {FAULTS_ENV}=1 (tests only, never production)"
            )
        self.client = client
        self._hit = client.register_script(_HIT)

    def fail(self, tool: str, *, nth: int = 1, times: int = 1, after_effect: bool = False) -> str:
        """Raise in ``tool`` on its ``nth`` call (and the ``times - 1`` after it)."""
        point = "after_effect" if after_effect else "before_effect"
        return self._add(point, tool, "raise", nth, times)

    def fail_compensation(self, tool: str, *, times: int = 1, nth: int = 1) -> str:
        return self._add("before_compensation", tool, "raise", nth, times)

    def kill(self, point: str, tool: str = "", *, nth: int = 1, whole_worker: bool = False) -> str:
        """SIGKILL the pool process (or the whole worker) when ``point`` is reached."""
        return self._add(point, tool, "kill_worker" if whole_worker else "kill", nth, 1)

    def delay(
        self,
        tool: str,
        seconds: float,
        *,
        nth: int = 1,
        times: int = 1,
        point: str = "before_effect",
    ) -> str:
        """Sleep ``seconds`` at ``point`` of ``tool`` (by default, before its effect)."""
        return self._add(point, tool, "delay", nth, times, seconds)

    def hits(self, rule_id: str) -> int:
        from saga.constants import FAULT_COUNTS_KEY

        return int(self.client.hget(FAULT_COUNTS_KEY, rule_id) or 0)

    def clear(self) -> None:
        from saga.constants import FAULT_COUNTS_KEY, FAULTS_KEY

        self.client.delete(FAULTS_KEY, FAULT_COUNTS_KEY)

    def strike(self, point: str, tool: str) -> None:
        """Called by the worker at each point; acts on the rules that match this call."""
        import json

        from saga.constants import FAULT_COUNTS_KEY, FAULTS_KEY
        from saga.errors import InjectedFaultError

        for raw in self._hit(keys=[FAULTS_KEY, FAULT_COUNTS_KEY], args=[point, tool]):
            rule = json.loads(raw)
            if rule["action"] == "delay":
                time.sleep(rule["seconds"])
            elif rule["action"] == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            elif rule["action"] == "kill_worker":
                os.killpg(os.getpgid(0), signal.SIGKILL)
            else:
                raise InjectedFaultError(f"injected fault at {point} of {tool} ({rule['id']})")

    def _add(
        self, point: str, tool: str, action: str, nth: int, times: int, seconds: float = 0.0
    ) -> str:
        import json

        from saga.constants import FAULTS_KEY

        if point not in FAULT_POINTS:
            raise ValueError(f"unknown fault point {point!r}; known: {', '.join(FAULT_POINTS)}")
        if nth < 1 or times < 1:
            raise ValueError("nth and times must be at least 1")
        rule_id = uuid.uuid4().hex[:12]
        rule = {"id": rule_id, "point": point, "tool": tool, "action": action, "nth": nth}
        rule.update(times=times, seconds=seconds)
        self.client.hset(FAULTS_KEY, rule_id, json.dumps(rule))
        return rule_id
