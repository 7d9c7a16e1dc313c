"""A Sentinel deployment for tests: a master, one replica and three sentinels, each a
``redis-server`` on a free port in its own process group, stopped by PID, every wait bounded."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import Self

import redis

from saga.testing import RedisServer
from saga.testing.processes import _stop_group, free_port

MASTER = "sagamaster"


def wait_until(check: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            if check():
                return
        except redis.RedisError:
            pass
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g}s waiting for {what}")
        time.sleep(0.1)


def role(port: int) -> str:
    client = redis.Redis(port=port, socket_timeout=2, decode_responses=True)
    try:
        return str(client.info("replication")["role"])
    finally:
        client.close()


class SentinelCluster:
    """Master and replica on ``ports``; sentinels on ``sentinel_ports``, quorum 2."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.master = RedisServer("--maxmemory-policy", "noeviction", directory=directory / "m")
        self.replica = RedisServer(
            "--maxmemory-policy", "noeviction", "--replicaof", "127.0.0.1",
            str(self.master.port), directory=directory / "r",
        )  # fmt: skip
        self.sentinel_ports = [free_port() for _ in range(3)]
        self._sentinels: list[subprocess.Popen[bytes]] = []

    @property
    def ports(self) -> tuple[int, int]:
        return self.master.port, self.replica.port

    def url(self, db: int = 0) -> str:
        hosts = ",".join(f"127.0.0.1:{port}" for port in self.sentinel_ports)
        return f"redis+sentinel://{hosts}/{MASTER}/{db}"

    def kombu_url(self, db: int = 0) -> str:
        return ";".join(f"sentinel://127.0.0.1:{port}/{db}" for port in self.sentinel_ports)

    def master_port(self) -> int:
        """Where the sentinels say the master is now."""
        client = self.sentinel(self.sentinel_ports[0])
        try:
            _, port = client.sentinel_get_master_addr_by_name(MASTER)
            return int(port)
        finally:
            client.close()

    def sentinel(self, port: int) -> redis.Redis:
        return redis.Redis(port=port, socket_timeout=2, decode_responses=True)

    def start(self, timeout: float = 30.0) -> Self:
        self.master.start()
        self.replica.start()
        for index, port in enumerate(self.sentinel_ports):
            config = self.directory / f"sentinel-{index}.conf"
            config.write_text(
                f"port {port}\nbind 127.0.0.1\ndir {self.directory}\n"
                f"sentinel monitor {MASTER} 127.0.0.1 {self.master.port} 2\n"
                f"sentinel down-after-milliseconds {MASTER} 1000\n"
                f"sentinel failover-timeout {MASTER} 5000\n"
            )
            self._sentinels.append(
                subprocess.Popen(
                    ["redis-server", str(config), "--sentinel", "--logfile", str(self._log(index))],
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                    start_new_session=True,
                )
            )
        try:
            wait_until(
                lambda: (
                    role(self.replica.port) == "slave"
                    and redis.Redis(port=self.replica.port, socket_timeout=2).info("replication")[
                        "master_link_status"
                    ]
                    == "up"
                ),
                timeout,
                "the replica to sync",
            )
            wait_until(self._ready, timeout, "every sentinel to see the replica and the others")
        except BaseException:
            self.stop()
            raise
        return self

    def _log(self, index: int) -> Path:
        return self.directory / f"sentinel-{index}.log"

    def sentinel_log(self, lines: int = 40) -> str:
        """The last ``lines`` of every sentinel's log: what a failed wait shows."""
        tails = []
        for index in range(len(self.sentinel_ports)):
            path = self._log(index)
            text = path.read_text(errors="replace").splitlines() if path.exists() else []
            tails.append(f"--- sentinel {index} ---\n" + "\n".join(text[-lines:]))
        return "\n".join(tails)

    def _ready(self) -> bool:
        for port in self.sentinel_ports:
            client = self.sentinel(port)
            try:
                state = client.sentinel_master(MASTER)
                if int(state["num-other-sentinels"]) < 2 or int(state["num-slaves"]) < 1:
                    return False
            finally:
                client.close()
        return True

    def failover(self, timeout: float = 60.0) -> int:
        """``SENTINEL FAILOVER``; returns once the sentinels name the new master, it is
        master, and the old one is its replica (the new master's port).

        The replica is first seen in sync (a previous failover's demoted master may still be
        loading the new one's data, and promoting it then would lose writes). A sentinel aborts
        a failover whose promotion it did not see within ``failover-timeout`` (a busy machine
        can take that long) and does not retry one it was asked for, so the request is made
        again until the deadline; a failed wait shows the sentinels' logs."""
        old = self.master_port()
        new = next(port for port in self.ports if port != old)
        deadline = time.monotonic() + timeout

        def remaining() -> float:
            return max(deadline - time.monotonic(), 0.1)

        try:
            wait_until(lambda: self._in_sync(new), remaining(), "the replica to be in sync")
            wait_until(self._ready, remaining(), "every sentinel to see the replica")
            while self.master_port() != new:
                client = self.sentinel(self.sentinel_ports[0])
                try:
                    client.execute_command("SENTINEL FAILOVER", MASTER)
                except redis.ResponseError:
                    pass  # INPROG: one is under way; NOGOODSLAVE: not yet eligible, ask again
                finally:
                    client.close()
                try:
                    wait_until(
                        lambda: self.master_port() == new,
                        min(15.0, remaining()),
                        "the sentinels to name the new master",
                    )
                except AssertionError:
                    if time.monotonic() >= deadline:
                        raise
            wait_until(lambda: role(new) == "master", remaining(), "the new master's promotion")
            wait_until(lambda: role(old) == "slave", remaining(), "the old master's demotion")
        except AssertionError as failed:
            raise AssertionError(f"{failed}\n{self.sentinel_log()}") from None
        return new

    def _in_sync(self, port: int) -> bool:
        """The replica on ``port`` is linked to its master, loaded, and caught up with it."""
        client = redis.Redis(port=port, socket_timeout=2, decode_responses=True)
        try:
            info = client.info("replication")
            if info["role"] != "slave" or info["master_link_status"] != "up":
                return False
            if client.info("persistence").get("loading", 0):
                return False
            master = redis.Redis(port=int(info["master_port"]), socket_timeout=2)
            try:
                offset = int(master.info("replication")["master_repl_offset"])
            finally:
                master.close()
            return int(info["slave_repl_offset"]) >= offset
        finally:
            client.close()

    def stop(self) -> None:
        for process in self._sentinels:
            _stop_group(process, 10)
        self._sentinels.clear()
        self.replica.stop()
        self.master.stop()

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
