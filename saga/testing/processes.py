"""A real Redis and a real Celery worker for tests, each started as a subprocess in its own
process group and stopped by PID, with every wait bounded."""

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


class _ProcessGroup:
    """A subprocess started in its own session: killed as a whole, as a crash would."""

    process: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 30.0) -> Self:
        raise NotImplementedError

    def stop(self, timeout: float = 20.0) -> None:
        raise NotImplementedError

    def kill(self) -> None:
        """SIGKILL the whole process group at once (a Redis keeps its data directory)."""
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


class RedisServer(_ProcessGroup):
    """A private ``redis-server`` on a free port, for tests that kill or restart Redis."""

    def __init__(
        self,
        *args: str,
        port: int | None = None,
        directory: Path | None = None,
        wrapper: Sequence[str] = (),
    ) -> None:
        """``wrapper``: a command the server runs under (``valgrind --tool=callgrind``, say)."""
        if shutil.which("redis-server") is None:
            raise RuntimeError(
                "redis-server is not installed (Debian: apt-get install redis-server)"
            )
        self.port = port or free_port()
        self.args = args
        self.wrapper = list(wrapper)
        self._own_dir = directory is None
        self.directory = directory or Path(tempfile.mkdtemp(prefix="saga-redis-"))
        self.directory.mkdir(parents=True, exist_ok=True)
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}"

    def start(self, timeout: float = 10.0) -> Self:
        command = [*self.wrapper, "redis-server", "--port", str(self.port), "--bind", "127.0.0.1"]
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


class WorkerProcess(_ProcessGroup):
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
        wrapper: Sequence[str] = (),
    ) -> None:
        """``wrapper``: a command the worker runs under (``valgrind --tool=callgrind``, say)."""
        self.app = app
        self.env = {**os.environ, **(env or {})}
        self.hostname = f"saga-test-{uuid.uuid4().hex[:8]}@%h"
        self.concurrency = concurrency
        self.pool = pool
        self.extra_args = list(extra_args)
        self.logfile = logfile or Path(tempfile.mkstemp(prefix="saga-worker-", suffix=".log")[1])
        self.cwd = cwd
        self.wrapper = list(wrapper)
        self.process: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 30.0) -> Self:
        self.logfile.write_text("")
        command = [*self.wrapper, sys.executable, "-m", "celery", "-A", self.app, "worker"]
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

    def restart(self, timeout: float = 30.0) -> Self:
        """Start it again (after a fault killed it, or to load changed code)."""
        self.stop()
        return self.start(timeout)

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None
