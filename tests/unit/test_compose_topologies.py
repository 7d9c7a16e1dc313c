"""The topology overrides (``compose.sentinel.yaml``, ``compose.cluster.yaml``,
``compose.rabbitmq.yaml``, ``compose.split.yaml``, and RabbitMQ or the split with another
store) on top of compose.yaml, merged as
``docker compose -f ... -f ...`` merges them, checked where no Docker engine runs: every saga
process reads the topology it is given (its environment run through saga's own settings and
Celery defaults), each credential comes from a secret it mounts, and the servers' own
configuration agrees with what saga is told."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml

from saga.redis_urls import is_cluster, parse_cluster, parse_sentinel

ROOT = Path(__file__).resolve().parents[2]
OURS = ("migrate", "worker", "turns", "beat", "flower", "api")
TOPOLOGIES = {
    "sentinel": ["compose.sentinel.yaml"],
    "rabbitmq": ["compose.rabbitmq.yaml"],
    "rabbitmq+sentinel": ["compose.sentinel.yaml", "compose.rabbitmq.yaml"],
    "cluster": ["compose.cluster.yaml"],
    "rabbitmq+cluster": ["compose.cluster.yaml", "compose.rabbitmq.yaml"],
    "split": ["compose.split.yaml"],
    "split+sentinel": ["compose.sentinel.yaml", "compose.split.yaml"],
}
#: Sequences compose merges (by value) instead of replacing.
MERGED_SEQUENCES = {"secrets", "volumes", "ports", "expose"}
MASTER = "sagamaster"


def _merge(base: Any, override: Any, key: str = "") -> Any:
    if isinstance(base, dict) and isinstance(override, dict):
        merged = dict(base)
        for name, value in override.items():
            merged[name] = _merge(base[name], value, name) if name in base else value
        return merged
    if key in MERGED_SEQUENCES and isinstance(base, list) and isinstance(override, list):
        return base + [item for item in override if item not in base]
    return override


def _deployment(topology: str) -> dict[str, Any]:
    merged: dict[str, Any] = yaml.safe_load((ROOT / "compose.yaml").read_text())
    for name in TOPOLOGIES[topology]:
        merged = _merge(merged, yaml.safe_load((ROOT / name).read_text()))
    return merged


def _interpolated(value: str) -> str:
    """``${NAME:-default}`` as its default, ``${NAME:?why}`` as a placeholder."""
    value = re.sub(r"\$\{[A-Z_]+:-([^}]*)\}", r"\1", value)
    return re.sub(r"\$\{[A-Z_]+:\?[^}]*\}", "set-by-the-operator", value)


def _read_by_saga(services: dict[str, Any], secrets: Path) -> dict[str, dict[str, Any]]:
    """What saga makes of each service's environment, in a fresh interpreter: the store's URL
    and settings, Celery's broker, results and transport options."""
    envs = {}
    for name in OURS:
        env = {k: _interpolated(str(v)) for k, v in services[name]["environment"].items()}
        envs[name] = {
            k: str(secrets / v.removeprefix("/run/secrets/")) if k.endswith("_FILE") else v
            for k, v in env.items()
        }
    code = """
import importlib, json, os, sys
envs = json.loads(sys.argv[1])
out = {}
for name, env in envs.items():
    for key in [k for k in os.environ if k.startswith("SAGA_")]:
        del os.environ[key]
    os.environ.update(env)
    from saga.settings import Settings
    import saga.celery_defaults as defaults
    defaults = importlib.reload(defaults)
    settings = Settings.from_env()
    out[name] = {
        "store": settings.redis_url,
        "confirm": settings.replicas_to_confirm,
        "shards": settings.index_layout().shards,
        "broker": defaults.broker_url,
        "results": defaults.result_backend,
        "broker_options": defaults.broker_transport_options,
        "result_options": defaults.result_backend_transport_options,
        "queues": [q.name for q in defaults.task_queues or ()],
    }
print(json.dumps(out, default=str))
"""
    done = subprocess.run(
        [sys.executable, "-c", code, json.dumps(envs)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return dict(json.loads(done.stdout))


@pytest.fixture(scope="module")
def secrets_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Every secret any topology names, as files (their content is the secret's own name)."""
    directory = tmp_path_factory.mktemp("secrets")
    for topology in TOPOLOGIES:
        for name in _deployment(topology)["secrets"]:
            (directory / name).write_text(f"pw-{name}\n")
    return directory


@pytest.mark.parametrize("topology", sorted(TOPOLOGIES))
def test_every_secret_and_volume_a_service_uses_is_declared_and_none_is_written(
    topology: str,
) -> None:
    deployment = _deployment(topology)
    declared = deployment["secrets"]
    assert all(s["file"].startswith("./secrets/") for s in declared.values())
    for name, service in deployment["services"].items():
        mounted = set(service.get("secrets", []))
        assert mounted <= set(declared), (name, mounted - set(declared))
        for variable, value in service.get("environment", {}).items():
            if variable.endswith("_FILE"):
                assert str(value).removeprefix("/run/secrets/") in mounted, (name, variable)
            elif re.search("PASSWORD|SECRET", variable):
                assert str(value).startswith("${"), (name, variable)
            if "://" in str(value):
                assert urlsplit(str(value).split(",")[0]).password is None, (name, variable)
        for volume in service.get("volumes", []):
            source = volume.split(":", 1)[0]
            assert source.startswith(("./", "/")) or source in deployment["volumes"], volume


def test_on_sentinel_every_process_finds_the_master_through_the_sentinels(
    secrets_dir: Path,
) -> None:
    read = _read_by_saga(_deployment("sentinel")["services"], secrets_dir)
    for name, seen in read.items():
        store = parse_sentinel(seen["store"])
        assert store is not None, name
        assert store.master == MASTER and len(store.sentinels) == 3, name
        assert seen["broker"].startswith("sentinel://") and seen["results"].startswith(
            "sentinel://"
        ), name
        for options in (seen["broker_options"], seen["result_options"]):
            assert options["master_name"] == MASTER, name
            assert options["sentinel_kwargs"]["password"] == "pw-redis_sentinel_password", name
    for name in ("worker", "turns", "beat", "api", "migrate"):
        assert read[name]["confirm"] == 1, name  # the writes that count wait for the replica
        assert f"{read[name]['store']}".startswith("redis+sentinel://saga:pw-redis_saga_password@")
    assert "flower:pw-redis_flower_password@" in read["flower"]["broker"]


def test_on_rabbitmq_the_broker_has_its_password_from_its_secret_and_results_stay_on_redis(
    secrets_dir: Path,
) -> None:
    for topology, results in (
        ("rabbitmq", "redis://"),
        ("rabbitmq+sentinel", "sentinel://"),
        ("rabbitmq+cluster", "redis://"),  # compose.yaml's plain `redis`: never the cluster
    ):
        read = _read_by_saga(_deployment(topology)["services"], secrets_dir)
        for name, seen in read.items():
            broker = urlsplit(seen["broker"])
            assert (broker.scheme, broker.username) == ("amqp", "saga"), (topology, name)
            assert broker.password == "pw-rabbitmq_saga_password", (topology, name)
            assert (broker.hostname, broker.path) == ("rabbitmq", "/saga"), (topology, name)
            assert seen["results"].startswith(results), (topology, name)
            assert seen["broker_options"] == {"confirm_publish": True}, (topology, name)
            assert set(seen["queues"]) == {"celery", "saga.turns"}, (topology, name)
        if topology == "rabbitmq+sentinel":
            assert parse_sentinel(read["worker"]["store"]) is not None
            assert read["worker"]["result_options"]["master_name"] == MASTER
        if topology == "rabbitmq+cluster":
            assert parse_cluster(read["worker"]["store"]) is not None
            assert urlsplit(read["worker"]["results"]).hostname == "redis"


def test_both_redis_servers_can_be_master_and_the_sentinels_watch_the_one_saga_names() -> None:
    services = _deployment("sentinel")["services"]
    master, replica = services["redis"], services["redis-replica"]
    assert master["entrypoint"] == replica["entrypoint"]  # the same users, the same login
    script = master["entrypoint"][2]
    assert "--user default off" in script and "masteruser replication" in script
    assert "+psync +replconf" in script.split("--user replication", 1)[1].split("--user")[0]
    sentinel_acl = script.split("--user sentinel", 1)[1]
    for command in ("+slaveof", "'+config|rewrite'", "+role", "+publish", "'+client|kill'"):
        assert command in sentinel_acl, command
    flags = master["command"]
    assert replica["command"][: len(flags)] == flags
    assert replica["command"][len(flags) :] == ["--replicaof", "redis", "6379"]
    pairs = dict(zip(flags[1::2], flags[2::2], strict=True))
    assert pairs["--appendfsync"] == "always" and pairs["--maxmemory-policy"] == "noeviction"
    assert pairs["--min-replicas-to-write"] == "1"
    assert pairs["--repl-diskless-sync-delay"] == "0"  # a demoted master resyncs at once
    sentinels = [services[f"sentinel-{i}"] for i in (1, 2, 3)]
    for index, sentinel in enumerate(sentinels, 1):
        config = sentinel["entrypoint"][2]
        assert f'"sentinel monitor {MASTER} redis 6379 2"' in config  # a quorum of 2 of 3
        assert f'"sentinel auth-user {MASTER} sentinel"' in config
        assert "requirepass" in config
        assert sentinel["environment"]["SENTINEL_HOSTNAME"] == f"sentinel-{index}"
        assert any(v.endswith(":/data") for v in sentinel["volumes"])  # keeps what it learnt
        assert "healthcheck" in sentinel and sentinel["restart"] == "unless-stopped"
    for name in ("worker", "turns", "beat", "api", "flower"):
        depends = services[name]["depends_on"]
        assert all(depends[f"sentinel-{i}"]["condition"] == "service_healthy" for i in (1, 2, 3))


def test_rabbitmq_is_configured_as_saga_is_told() -> None:
    services = _deployment("rabbitmq")["services"]
    script = services["rabbitmq"]["entrypoint"][2]
    config = dict(re.findall(r'"(\w[\w.]*) = ([^"]*)"', script))
    worker = services["worker"]["environment"]
    broker = urlsplit(worker["SAGA_BROKER_URL"])
    assert config["default_user"] == broker.username
    assert config["default_vhost"] == broker.path.strip("/")
    assert config["default_pass"] == "$$(cat /run/secrets/rabbitmq_saga_password)"
    # The broker's patience with an unacked step is what the start-up guard is told it is.
    assert int(config["consumer_timeout"]) == 1000 * int(worker["SAGA_RABBITMQ_CONSUMER_TIMEOUT"])
    assert services["rabbitmq"]["hostname"] == "rabbitmq"  # the node's name, and its data
    assert any(v.endswith(":/var/lib/rabbitmq") for v in services["rabbitmq"]["volumes"])
    for name in ("worker", "turns", "beat", "api", "flower"):
        assert services[name]["depends_on"]["rabbitmq"]["condition"] == "service_healthy"


#: The saga processes that open the store (Flower reads the broker and the results only).
STORE_USERS = ("migrate", "worker", "turns", "beat", "api")


def _cluster_nodes(services: dict[str, Any]) -> dict[str, Any]:
    return {
        name: service
        for name, service in services.items()
        if "--cluster-enabled" in service.get("command", [])
    }


def _flags(command: list[str]) -> dict[str, str]:
    return dict(zip(command[1::2], command[2::2], strict=True))


def _acl(script: str, user: str) -> str:
    """What ``--user <user>`` grants in a server's entrypoint script (up to the next user)."""
    return script.split(f"--user {user} ", 1)[1].split(" --user ")[0].strip()


@pytest.mark.parametrize("topology", ["cluster", "rabbitmq+cluster"])
def test_on_the_cluster_the_store_names_every_node_and_the_broker_stays_off_it(
    topology: str, secrets_dir: Path
) -> None:
    services = _deployment(topology)["services"]
    nodes = _cluster_nodes(services)
    read = _read_by_saga(services, secrets_dir)
    named = {(service["hostname"], 6379) for service in nodes.values()}
    for name in STORE_USERS:
        seen = read[name]
        store = parse_cluster(seen["store"])
        assert store is not None, (topology, name)
        assert set(store.nodes) == named and len(store.nodes) == len(named), (topology, name)
        assert (store.username, store.password) == ("saga", "pw-redis_saga_password"), name
        assert seen["confirm"] == 1, (topology, name)  # the writes that count wait for a replica
        # Neither Celery's broker nor its results can be a cluster: both on the plain `redis`
        # (or the broker on RabbitMQ), which is no cluster node.
        assert not is_cluster(seen["broker"]) and not is_cluster(seen["results"]), name
        assert urlsplit(seen["results"]).hostname == "redis" and "redis" not in nodes, name
        if topology == "cluster":
            assert seen["broker"] == "redis://saga:pw-redis_saga_password@redis:6379/0", name
    # One index layout for every process (one configured otherwise refuses to start), as said.
    said = {services[n]["environment"].get("SAGA_INDEX_SHARDS") for n in STORE_USERS}
    assert len(said) == 1 and {read[n]["shards"] for n in STORE_USERS} == {int(said.pop())}
    assert not any(is_cluster(str(url)) for url in read["flower"].values())


def test_every_cluster_node_can_be_master_and_is_configured_as_saga_is_told() -> None:
    services = _deployment("cluster")["services"]
    nodes = _cluster_nodes(services)
    first = next(iter(nodes.values()))
    script, flags = first["entrypoint"][2], _flags(first["command"])
    plain = yaml.safe_load((ROOT / "compose.yaml").read_text())["services"]["redis"]
    worker = services["worker"]["environment"]
    create = services["cluster-create"]
    replicas = int(create["environment"]["CLUSTER_REPLICAS"])
    assert len(nodes) == 6 and len(nodes) // (1 + replicas) >= 3  # three masters at least
    data = set()
    for name, node in nodes.items():
        # The same users, flags and replication login on each: any can be master or replica.
        assert (node["entrypoint"], node["command"]) == (first["entrypoint"], first["command"])
        assert node["hostname"] == name  # its name in the slot map and in MOVED answers
        [volume] = [v for v in node["volumes"] if v.endswith(":/data")]  # nodes.conf, the AOF
        data.add(volume)
        assert set(re.findall(r"\(h (\w+)\)", script)) <= set(node["secrets"]), name
        assert "healthcheck" in node and node["restart"] == "unless-stopped"
    assert len(data) == len(nodes)  # a volume each
    assert flags["--cluster-enabled"] == "yes"
    assert flags["--cluster-config-file"].startswith("/data/")
    assert flags["--cluster-preferred-endpoint-type"] == "hostname"
    assert '--cluster-announce-hostname "$$(hostname)"' in script
    assert flags["--appendfsync"] == "always" and flags["--maxmemory-policy"] == "noeviction"
    assert flags["--repl-diskless-sync-delay"] == "0"  # a demoted master resyncs at once
    # A master cut off from its replicas refuses writes rather than take ones a failover loses;
    # each master has as many replicas as saga waits for.
    confirm = int(worker["SAGA_REDIS_CONFIRM_REPLICAS"])
    assert int(flags["--min-replicas-to-write"]) >= confirm and replicas >= confirm >= 1
    assert "--user default off" in script and "masteruser replication" in script
    assert _acl(script, "saga") == _acl(plain["entrypoint"][2], "saga")  # one saga login
    assert _acl(script, "replication").endswith("-@all +psync +replconf +ping")
    assert "'+cluster|slots'" in _acl(script, "readonly")  # a cluster client's first read
    assert "--user flower" not in script  # Flower never opens the store
    # The one-shot forms the cluster of the nodes saga names, once, with no password in sight.
    told = parse_cluster(worker["SAGA_REDIS_URL"])
    assert told is not None
    assert set(create["environment"]["CLUSTER_NODES"].split()) == {
        f"{h}:{p}" for h, p in told.nodes
    }
    created = create["entrypoint"][2]
    for part in ("--cluster create", "--cluster-replicas", "--cluster-yes"):
        assert part in created, part
    assert "cluster_slots_assigned:0" in created  # skipped when the nodes hold slots already
    assert "cluster_state:ok" in created  # and done only once every node says so
    assert 'REDISCLI_AUTH="$$(cat /run/secrets/redis_admin_password)"' in created
    assert not re.search(r"\s(-a|--pass)\s", created)
    assert "redis_admin_password" in create["secrets"] and create["restart"] == "no"
    assert "+@all" in _acl(script, "admin")
    assert all(create["depends_on"][n]["condition"] == "service_healthy" for n in nodes)
    for name in ("worker", "turns", "beat", "api"):
        depends = services[name]["depends_on"]
        assert depends["cluster-create"]["condition"] == "service_completed_successfully"
        assert depends["redis"]["condition"] == "service_healthy"  # the broker's


@pytest.mark.parametrize("topology", ["split", "split+sentinel"])
def test_split_puts_the_broker_and_results_on_a_redis_without_persistence(
    topology: str, secrets_dir: Path
) -> None:
    services = _deployment(topology)["services"]
    read = _read_by_saga(services, secrets_dir)
    broker = services["redis-broker"]
    for name in STORE_USERS:
        seen = read[name]
        assert seen["broker"] == "redis://saga:pw-redis_saga_password@redis-broker:6379/0", name
        assert seen["results"] == "redis://saga:pw-redis_saga_password@redis-broker:6379/1", name
        # The store stays where compose.yaml (or compose.sentinel.yaml) puts it, durable.
        if topology == "split":
            assert seen["store"] == "redis://saga:pw-redis_saga_password@redis:6379/2", name
        else:
            assert parse_sentinel(seen["store"]) is not None and seen["confirm"] == 1, name
    assert read["flower"]["broker"] == "redis://flower:pw-redis_flower_password@redis-broker:6379/0"
    assert read["flower"]["results"].endswith("@redis-broker:6379/1")
    # Nothing the broker holds reaches a disk, and a full one refuses rather than evicts.
    flags = _flags(broker["command"])
    assert flags == {"--appendonly": "no", "--save": "", "--maxmemory-policy": "noeviction"}
    assert "volumes" not in broker
    store = _flags(services["redis"]["command"])
    assert store["--appendonly"] == "yes" and store["--appendfsync"] == "always"
    # The store's logins, from the same secrets; the API's read-only user never opens it.
    plain = yaml.safe_load((ROOT / "compose.yaml").read_text())["services"]["redis"]
    script = broker["entrypoint"][2]
    assert "--user default off" in script and "--user readonly" not in script
    for user in ("saga", "flower"):
        assert _acl(script, user) == _acl(plain["entrypoint"][2], user), user
    assert set(re.findall(r"\(h (\w+)\)", script)) == set(broker["secrets"])
    assert "healthcheck" in broker and broker["restart"] == "unless-stopped"
    for name in ("worker", "turns", "beat", "api", "flower"):
        assert services[name]["depends_on"]["redis-broker"]["condition"] == "service_healthy"
