"""A private RabbitMQ node for tests that restart the broker or drop its connections: its own
node name, ports, data and logs under a directory of its own, its own Erlang cookie; started in
its own process group, stopped by PID, every wait bounded. The machine's RabbitMQ is never
touched (tests that only need a broker use a vhost of their own on it, ``tests.conftest``)."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
import uuid
from pathlib import Path
from typing import Self

from saga.testing.processes import _ProcessGroup, _stop_group, free_port

#: The server's own launcher. Debian's ``/usr/sbin/rabbitmq-server`` switches to the
#: ``rabbitmq`` user and to the machine's data directory, so it is used only when this is missing.
LAUNCHERS = ("/usr/lib/rabbitmq/bin/rabbitmq-server", "rabbitmq-server")
CONTROLS = ("/usr/lib/rabbitmq/bin/rabbitmqctl", "rabbitmqctl")
#: Seconds the queue lengths ``rabbitmqctl list_queues`` gives may lag behind (measured here:
#: a published message showed after 5 s, whatever ``collect_statistics_interval`` said).
STATISTICS_LAG = 5.5


def _found(candidates: tuple[str, ...]) -> str:
    for candidate in candidates:
        path = candidate if os.path.isabs(candidate) else shutil.which(candidate)
        if path and os.access(path, os.X_OK):
            return path
    raise RuntimeError(
        f"{candidates[-1]} is not installed (Debian: apt-get install rabbitmq-server)"
    )


class RabbitNode(_ProcessGroup):
    """``rabbitmq-server`` as ``saga-<id>@localhost`` on free ports, data in ``directory``
    (``with RabbitNode(d) as node:`` starts and stops it)."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.port = free_port()
        self.dist_port = free_port()
        self.name = f"saga-{uuid.uuid4().hex[:8]}@localhost"
        self.process: subprocess.Popen[bytes] | None = None
        self.starts = 0
        self.home = directory / "home"  # the Erlang cookie the node and rabbitmqctl share
        for sub in ("home", "mnesia", "log"):
            (directory / sub).mkdir(parents=True, exist_ok=True)
        (directory / "enabled_plugins").write_text("[].\n")
        (directory / "rabbitmq.conf").write_text(
            f"listeners.tcp.default = 127.0.0.1:{self.port}\n"
            "loopback_users = none\n"
            # A restarted node must not refuse to start waiting for peers it never had.
            "cluster_formation.peer_discovery_backend = classic_config\n"
        )

    @property
    def url(self) -> str:
        return f"amqp://guest:guest@127.0.0.1:{self.port}//"

    def _env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("RABBITMQ_")}
        return {
            **env,
            "HOME": str(self.home),
            "RABBITMQ_NODENAME": self.name,
            "RABBITMQ_NODE_PORT": str(self.port),
            "RABBITMQ_DIST_PORT": str(self.dist_port),
            "RABBITMQ_MNESIA_BASE": str(self.directory / "mnesia"),
            "RABBITMQ_LOG_BASE": str(self.directory / "log"),
            "RABBITMQ_ENABLED_PLUGINS_FILE": str(self.directory / "enabled_plugins"),
            "RABBITMQ_CONFIG_FILE": str(self.directory / "rabbitmq"),
            "RABBITMQ_PID_FILE": str(self.directory / "pid"),
        }

    def start(self, timeout: float = 90.0) -> Self:
        """Start the node (with the data it had, after a ``stop``) and wait for AMQP."""
        log = (self.directory / "server.out").open("ab")
        self.process = subprocess.Popen(
            [_found(LAUNCHERS)],
            env=self._env(),
            cwd=self.directory,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        log.close()
        self.starts += 1
        deadline = time.monotonic() + timeout
        while not self._answers():
            if self.process.poll() is not None:
                raise RuntimeError(f"rabbitmq-server exited at start:\n{self.output()}")
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"rabbitmq-server not up in {timeout:g}s:\n{self.output()}")
            time.sleep(0.2)
        return self

    def _answers(self) -> bool:
        """The AMQP port speaks AMQP (the listener opens late in the boot)."""
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=1) as sock:
                sock.sendall(b"AMQP\x00\x00\x09\x01")
                return sock.recv(8)[:1] == b"\x01"  # connection.start
        except OSError:
            return False

    def output(self, lines: int = 30) -> str:
        path = self.directory / "server.out"
        text = path.read_text(errors="replace").splitlines() if path.exists() else []
        return "\n".join(text[-lines:])

    def stop(self, timeout: float = 60.0) -> None:
        """SIGTERM the node's process group (a clean shutdown keeps its queues), then SIGKILL."""
        if self.process is not None:
            _stop_group(self.process, timeout)
            self.process = None

    def restart(self, timeout: float = 90.0) -> float:
        """Stop and start again on the same ports and data; the seconds it was away."""
        began = time.monotonic()
        self.stop()
        self.start(timeout)
        return time.monotonic() - began

    def ctl(self, *args: str, timeout: float = 60.0) -> str:
        """``rabbitmqctl -n <node> <args>``: its output; a failure raises with its message."""
        env = {k: v for k, v in self._env().items() if k not in ("RABBITMQ_DIST_PORT",)}
        done = subprocess.run(
            [_found(CONTROLS), "-n", self.name, "-q", *args],
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
        if done.returncode != 0:
            raise RuntimeError(f"rabbitmqctl {' '.join(args)}: {done.stderr or done.stdout}")
        return done.stdout

    def drop_connections(self) -> int:
        """Close every client connection (as a network blip or a load balancer would)."""
        listed = self.ctl("list_connections", "pid").split()
        self.ctl("close_all_connections", "saga test: connection dropped")
        return len(listed)

    def messages(self) -> int:
        """Messages in the node's queues, ready and delivered-not-yet-acknowledged . The node
        updates the figures every 5 s (``STATISTICS_LAG``): a wait for a quiet broker waits
        longer than that."""
        total = 0
        for line in self.ctl("list_queues", "messages").splitlines():
            line = line.strip()
            if line.isdigit():
                total += int(line)
        return total
