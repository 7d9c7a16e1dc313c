"""A Redis Cluster for tests: three masters and three replicas, each a ``redis-server`` with
``--cluster-enabled yes`` on a free port (its cluster bus, port + 10000, free too) in its own
process group, joined by ``redis-cli --cluster create``, stopped by PID, every wait bounded."""

from __future__ import annotations

import re
import socket
import subprocess
from pathlib import Path
from types import TracebackType
from typing import Self

import redis
from redis.crc import key_slot

from saga.testing import RedisServer
from tests.reliability.sentinel_cluster import wait_until

#: A cluster node's bus listens on its port + 10000 (Redis's fixed offset).
BUS_OFFSET = 10000


def _free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def cluster_port() -> int:
    """A free port whose cluster bus port is free too."""
    for _ in range(200):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            probe.bind(("127.0.0.1", 0))
            port = int(probe.getsockname()[1])
        if port + BUS_OFFSET < 65536 and _free(port + BUS_OFFSET):
            return port
    raise RuntimeError("no free port with a free cluster bus port")


def _cluster_state(client: redis.Redis) -> str:
    text = str(client.execute_command("CLUSTER", "INFO"))
    found = re.search(r"cluster_state:(\w+)", text)
    return found.group(1) if found else "unknown"


def _client(port: int) -> redis.Redis:
    return redis.Redis(port=port, socket_timeout=3, decode_responses=True)


class RedisClusterNodes:
    """``masters`` masters, each with ``replicas_each`` replicas, on ports of their own."""

    def __init__(self, directory: Path, masters: int = 3, replicas_each: int = 1) -> None:
        self.directory = directory
        self.masters = masters
        self.replicas_each = replicas_each
        count = masters * (1 + replicas_each)
        self.servers = [
            RedisServer(
                "--cluster-enabled",
                "yes",
                "--cluster-config-file",
                "nodes.conf",
                "--cluster-node-timeout",
                "2000",
                "--appendonly",
                "no",
                "--maxmemory-policy",
                "noeviction",
                "--repl-diskless-sync-delay",
                "0",
                port=cluster_port(),
                directory=directory / f"n{index}",
            )
            for index in range(count)
        ]

    @property
    def ports(self) -> list[int]:
        return [server.port for server in self.servers]

    def url(self) -> str:
        """The store's URL: every node a seed (the client learns the slots from any)."""
        return "redis+cluster://" + ",".join(f"127.0.0.1:{port}" for port in self.ports)

    def start(self, timeout: float = 60.0) -> Self:
        try:
            for server in self.servers:
                server.start()
            done = subprocess.run(
                [
                    "redis-cli", "--cluster", "create",
                    *(f"127.0.0.1:{port}" for port in self.ports),
                    "--cluster-replicas", str(self.replicas_each), "--cluster-yes",
                ],
                capture_output=True, text=True, timeout=timeout,
            )  # fmt: skip
            if done.returncode != 0:
                raise RuntimeError(f"redis-cli --cluster create failed: {done.stdout}{done.stderr}")
            wait_until(self._healthy, timeout, "the cluster to be ok with every replica in sync")
        except BaseException:
            self.stop()
            raise
        return self

    def _healthy(self) -> bool:
        for port in self.live_ports():
            client = _client(port)
            try:
                if _cluster_state(client) != "ok":
                    return False
                info = client.info("replication")
                if info["role"] == "slave" and info["master_link_status"] != "up":
                    return False
            finally:
                client.close()
        return len(self.master_ports()) == self.masters

    def live_ports(self) -> list[int]:
        return [s.port for s in self.servers if s.process is not None and s.process.poll() is None]

    def role(self, port: int) -> str:
        client = _client(port)
        try:
            return str(client.info("replication")["role"])
        finally:
            client.close()

    def master_ports(self) -> list[int]:
        """The live nodes that are masters now, by port."""
        found = []
        for port in self.live_ports():
            try:
                if self.role(port) == "master":
                    found.append(port)
            except redis.RedisError:
                continue
        return sorted(found)

    def replica_of(self, master_port: int) -> int:
        """A live replica of the master on ``master_port``."""
        for port in self.live_ports():
            client = _client(port)
            try:
                info = client.info("replication")
                if info["role"] == "slave" and int(info["master_port"]) == master_port:
                    return port
            except redis.RedisError:
                continue
            finally:
                client.close()
        raise AssertionError(f"no live replica of the master on {master_port}")

    def master_of_key(self, key: str) -> int:
        """The port of the master serving ``key``'s slot now."""
        client = _client(self.master_ports()[0])
        try:
            slot = key_slot(key.encode())
            for start, end, master, *_ in client.execute_command("CLUSTER", "SLOTS"):
                if int(start) <= slot <= int(end):
                    return int(master[1])
        finally:
            client.close()
        raise AssertionError(f"no master serves the slot of {key!r}")

    def failover(self, master_port: int, timeout: float = 30.0) -> int:
        """``CLUSTER FAILOVER`` on a replica of ``master_port``, once it is in sync (the
        manual failover waits for its master's offset: nothing acknowledged is lost); returns
        the new master's port once every live node agrees on it."""
        replica = self.replica_of(master_port)
        client = _client(replica)
        try:
            client.execute_command("CLUSTER FAILOVER")
        finally:
            client.close()
        wait_until(lambda: self.role(replica) == "master", timeout, "the replica's promotion")
        wait_until(lambda: self.role(master_port) == "slave", timeout, "the master's demotion")
        wait_until(self._healthy, timeout, "the cluster to be ok after the failover")
        return replica

    def kill_master(self, master_port: int, timeout: float = 30.0) -> int:
        """SIGKILL the master on ``master_port``; its replica is promoted once the others judge
        it failed (``cluster-node-timeout``). Returns the promoted replica's port; the killed
        node stays down until ``restart``."""
        replica = self.replica_of(master_port)
        server = self.server(master_port)
        assert server.process is not None
        server.process.kill()
        server.process.wait(timeout=10)
        server.process = None
        wait_until(lambda: self.role(replica) == "master", timeout, "the replica's promotion")
        wait_until(self._all_ok, timeout, "the cluster to be ok without the killed master")
        return replica

    def _all_ok(self) -> bool:
        for port in self.live_ports():
            client = _client(port)
            try:
                if _cluster_state(client) != "ok":
                    return False
            finally:
                client.close()
        return True

    def restart(self, port: int, timeout: float = 30.0) -> None:
        """Start the node on ``port`` again (it rejoins from its nodes.conf, as a replica)."""
        self.server(port).start()
        wait_until(self._healthy, timeout, "the restarted node to rejoin in sync")

    def server(self, port: int) -> RedisServer:
        return next(s for s in self.servers if s.port == port)

    def stop(self) -> None:
        for server in self.servers:
            server.stop()

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
