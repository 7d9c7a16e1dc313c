"""The ``saga`` command, run as the installed console script against real services: a private
Redis (AOF, noeviction), a real Celery worker, and the records on SQLite and on PostgreSQL.

Runs are driven by a Saga in this process; every check goes through the command's output and
exit code, and what it changed is checked in the records and the demo's systems.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from celery import Celery

from saga import RunState, Saga, Settings, StepFailedError
from saga.escalations import SCHEMA_VERSION
from saga.redis_urls import redis_client
from saga.testing import RedisServer, WorkerProcess, free_port
from tasks import systems
from tests.conftest import ROOT, postgres_schema, service_missing
from tests.integration.helpers import EMAIL, TICKET, demo_steps, wait_until

pytestmark = pytest.mark.timeout(300)
#: For the commands whose answers do not depend on the records' database: SQLite only (the
#: others run on both, SQLite and PostgreSQL).
SQLITE_ONLY = pytest.mark.parametrize("world", ["sqlite"], indirect=True)

SAGA = str(Path(sys.executable).with_name("saga"))
APP = "tasks.app:saga"


@dataclass
class World:
    """One deployment: its Redis database, records, worker, and a Saga to drive runs."""

    env: dict[str, str]
    saga: Saga
    data: Path

    def cli(self, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
        """``saga ARGS`` as a user would run it, in this deployment's environment."""
        return subprocess.run(
            [SAGA, *args],
            env={**os.environ, **self.env, **env},
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=180,
            check=False,
        )

    def cli_json(self, *args: str) -> Any:
        done = self.cli(*args, "--json")
        assert done.returncode == 0, done.stderr
        return json.loads(done.stdout)


@pytest.fixture(scope="module")
def private_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """Its own server, persisting as production should, so ``doctor`` can find it healthy."""
    if shutil.which("redis-server") is None:
        service_missing("redis-server is not installed (Debian: apt-get install redis-server)")
    directory = tmp_path_factory.mktemp("cli-redis")
    with RedisServer("--appendonly", "yes", "--appendfsync", "always", directory=directory) as r:
        yield r


@pytest.fixture(
    scope="module", params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)]
)
def world(
    request: pytest.FixtureRequest,
    private_redis: RedisServer,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[World]:
    data = tmp_path_factory.mktemp(f"cli-{request.param}")
    schemas = contextlib.ExitStack()
    if request.param == "postgres":
        _, database_url = schemas.enter_context(postgres_schema("cli"))
        url = private_redis.url + "/1"
    else:
        database_url = f"sqlite:///{data / 'saga.db'}"
        url = private_redis.url + "/0"
    imported_before = set(sys.modules)
    env = {
        "SAGA_REDIS_URL": url,
        "SAGA_BROKER_URL": url,
        "SAGA_RESULT_BACKEND": url,
        "SAGA_DATABASE_URL": database_url,
        "SAGA_DEMO_DATA": str(data),
        "SAGA_REAP_INTERVAL": "1",
        "PYTHONPATH": str(ROOT),
        # What requeue, resolve and reap import (nothing is guessed).
        "SAGA_APP": APP,
    }
    with pytest.MonkeyPatch.context() as patch:
        for key, value in env.items():
            patch.setenv(key, value)
        app = Celery("cli-test")
        app.config_from_object("celeryconfig")
        app.conf.update(broker_url=url, result_backend=url)
        saga = Saga(app, _tools(), Settings(redis_url=url, database_url=database_url))
        systems.reset()
        # One worker serves the tools and the demo agent's turns: doctor wants both served.
        worker = WorkerProcess(
            "tasks.app",
            env=env,
            cwd=ROOT,
            extra_args=["-Q", "celery,saga.turns"],
            logfile=data / "worker.log",
        )
        with worker:
            yield World(env, saga, data)
        saga.store.client.flushdb()
        saga.store.client.close()
        saga.records.dispose()
        systems.dispose_engines()
    schemas.close()
    # The settings modules read the environment when first imported: those imported here (this
    # module's private Redis) must not outlive it, or later tests would talk to a stopped server.
    for name in set(sys.modules) - imported_before:
        if name == "celeryconfig" or name.startswith(("saga.celery_defaults", "tasks.")):
            del sys.modules[name]


def _tools() -> Any:
    from tasks.tools import tools

    return tools


def escalate_failed_compensation(world: World) -> str:
    """The ticket system goes down after three steps, then the reply fails: the ticket's
    restore gives up after its retries, the credit is reversed, the run escalates."""
    systems.reset()
    run = world.saga.start_run()
    demo_steps(run, upto=3)
    systems.set_down("tickets")
    systems.set_down("mail")
    with pytest.raises(StepFailedError):
        run.call("send_reply", to=EMAIL, subject="s", body="b").result(timeout=30)
    assert run.wait(timeout=60).state is RunState.ESCALATED
    return run.run_id


def escalate_after_the_pivot(world: World) -> str:
    """The reply goes out (the pivot), then the webhook fails: nothing is unwound."""
    systems.reset()
    systems.set_down("webhook")
    run = world.saga.start_run()
    demo_steps(run)
    with pytest.raises(StepFailedError):
        run.call("notify_webhook", url="https://crm.example/h", event={"a": 1}).result(timeout=30)
    assert run.wait(timeout=60).state is RunState.ESCALATED
    return run.run_id


@pytest.fixture(scope="module")
def escalated(world: World) -> str:
    """A run escalated by a failed compensation, looked at (not changed) by several tests."""
    try:
        return escalate_failed_compensation(world)
    finally:
        systems.clear_switches()


# -- looking -----------------------------------------------------------------------------------


def test_escalations_lists_the_open_escalation_as_json(world: World, escalated: str) -> None:
    # When the open escalations are listed for a script
    listed = world.cli_json("escalations")

    # Then this run's escalation is there, open, with what it left live and what failed
    [item] = [e for e in listed["escalations"] if e["run_id"] == escalated]
    assert item["escalation_id"] == f"{escalated}:0"
    assert (item["open"], item["reason"], item["failed_compensations"]) == (
        True,
        "compensation failed",
        1,
    )
    assert item["live"] == 1


@SQLITE_ONLY
def test_escalation_markdown_holds_the_whole_picture_and_the_requeue_command(
    world: World, escalated: str
) -> None:
    # When the escalation is shown as Markdown, for a ticket
    done = world.cli("escalation", "show", f"{escalated}:0", "--markdown")

    # Then it has every section, the failed undo's errors, and the exact commands
    assert done.returncode == 0, done.stderr
    markdown = done.stdout
    for heading in ("### Timeline", "### Steps", "### Stack", "### Failed compensations"):
        assert heading in markdown
    assert "### Still live in the world" in markdown
    assert f"saga --app {APP} requeue {escalated}" in markdown
    assert f"saga --app {APP} resolve {escalated}:0 --note" in markdown
    assert markdown.count("tickets is down") >= 3  # each attempt's error, in the table
    assert f"`{escalated}:3:undo`" in markdown  # the captured idempotency key


def test_escalation_json_is_the_versioned_package(world: World, escalated: str) -> None:
    # When the escalation is shown as JSON
    package = json.loads(world.cli("escalation", "show", f"{escalated}:0", "--json").stdout)

    # Then it is the schema's document: why, the run's steps, each attempt's error, commands
    assert package["schema_version"] == SCHEMA_VERSION
    assert package["kind"] == "saga.escalation"
    assert package["why"]["kind"] == "compensation_failed"
    assert package["cause"] == "step 4 failed"
    steps = {s["step"]: s for s in package["run"]["steps"]}
    assert (steps[2]["tool"], steps[2]["tool_class"], steps[2]["state"]) == (
        "issue_credit",
        4,
        "succeeded",
    )
    assert steps[4]["state"] == "failed" and steps[4]["attempts"] == 3
    [failed] = package["failed_compensations"]
    assert failed["step"] == 3 and failed["undo"]["args"] == {"ticket_id": TICKET, "status": "open"}
    assert [e["attempt"] for e in failed["errors"]] == [1, 2, 3]
    assert {e["message"] for e in failed["errors"]} == {"tickets is down"}
    assert [(i["tool"], i["why"]) for i in package["live"]] == [
        ("set_ticket_status", "its compensation failed")
    ]
    assert package["requeueable"] is True
    assert package["commands"]["requeue"] == f"saga --app {APP} requeue {escalated}"


@SQLITE_ONLY
def test_escalation_card_and_show_draw_the_timeline(world: World, escalated: str) -> None:
    # When the card and the run are shown in the terminal
    card = world.cli("escalation", "show", f"{escalated}:0")
    shown = world.cli("show", escalated)

    # Then both draw the seed's timeline: classes, the pivot line, the unwind with ✓ and ✗
    assert card.returncode == shown.returncode == 0, card.stderr + shown.stderr
    assert f"ESCALATION {escalated}:0" in card.stdout
    for output in (card.stdout, shown.stdout):
        lines = [line.rstrip() for line in output.splitlines()]
        pivot = next(i for i, line in enumerate(lines) if " PIVOT " in line)
        assert "③ set_ticket_status" in lines[pivot - 1] and "④ send_reply" in lines[pivot + 1]
        assert "class ④ ✓  push: reverse_credit" in output
        unwind = lines.index("   UNWIND (reverse order)")
        assert lines[unwind + 1].startswith("   ③ set_ticket_status") and "✗" in lines[unwind + 1]
        assert lines[unwind + 2].startswith("   ② reverse_credit") and "✓" in lines[unwind + 2]
        assert "→ run ends escalated (compensation failed)" in output
    assert f"escalation {escalated}:0 is open" in shown.stdout


def test_runs_filters_by_state_tool_and_time(world: World, escalated: str) -> None:
    # When runs are listed with filters
    escalated_runs = world.cli_json("runs", "--state", "escalated", "--tool", "send_reply")
    none_since = world.cli_json("runs", "--since", "2999-01-01")
    no_such_tool = world.cli_json("runs", "--tool", "launch_rocket")

    # Then each filter keeps what it says
    [row] = [r for r in escalated_runs["runs"] if r["run_id"] == escalated]
    assert row["tools"] == ["get_order", "issue_credit", "set_ticket_status", "send_reply"]
    assert row["open_escalation"] == f"{escalated}:0"
    assert {r["state"] for r in escalated_runs["runs"]} == {"escalated"}
    assert none_since["runs"] == [] and no_such_tool["runs"] == []
    # and a bad --since is a usage error
    assert world.cli("runs", "--since", "yesterday-ish").returncode == 2


@SQLITE_ONLY
def test_read_only_commands_never_import_the_app(world: World, escalated: str) -> None:
    """Looking needs only the URLs; acting needs the app, and says so (exit 2)."""
    bad = ("--app", "no_such_module:saga")
    for args in (["runs"], ["show", escalated], ["escalations"], ["escalation", "show"]):
        if args == ["escalation", "show"]:
            args = [*args, f"{escalated}:0"]
        done = world.cli(*bad, *args)
        assert done.returncode == 0, (args, done.stderr)
    refused = world.cli(*bad, "requeue", escalated)
    assert refused.returncode == 2
    assert "cannot import the app no_such_module:saga" in refused.stderr


def test_read_only_commands_fall_back_to_the_records_when_redis_is_away(
    world: World, escalated: str
) -> None:
    # Given Redis does not answer (the records database does)
    away = f"redis://127.0.0.1:{free_port()}/0"

    # When the escalation, the run and the listings are asked for
    package = world.cli("escalation", "show", f"{escalated}:0", "--json", SAGA_REDIS_URL=away)
    shown = world.cli("show", escalated, "--json", SAGA_REDIS_URL=away)
    listed = world.cli("runs", "--json", "--state", "escalated", SAGA_REDIS_URL=away)

    # Then each answers from the records, and says on stderr that Redis was not read
    for done in (package, shown, listed):
        assert done.returncode == 0, done.stderr
        assert "Redis does not answer" in done.stderr
    # and the card says Redis did not answer, never that the run's keys expired
    card = " ".join(world.cli("show", escalated, SAGA_REDIS_URL=away).stdout.split())
    assert "read from the database: Redis did not answer" in card
    assert "expired" not in card
    assert json.loads(shown.stdout)["redis_unreachable"] is True
    run = json.loads(package.stdout)["run"]
    assert run["source"] == "database" and run["state"] == "escalated"
    assert [c["state"] for c in run["compensations"]] == ["failed", "done"]
    assert json.loads(shown.stdout)["source"] == "database"
    rows = json.loads(listed.stdout)["runs"]
    assert [r["source"] for r in rows if r["run_id"] == escalated] == ["database"]


# -- acting ------------------------------------------------------------------------------------


def test_requeue_escalates_again_then_compensates_once_the_fault_is_fixed(world: World) -> None:
    # Given a run escalated by a failed ticket restore
    run_id = escalate_failed_compensation(world)

    # When it is requeued with the ticket system still down
    again = world.cli("requeue", run_id, "--timeout", "90")

    # Then it escalates again: exit 1, naming the new escalation
    assert again.returncode == 1, again.stderr
    assert f"escalation show {run_id}:1" in again.stderr

    # When a correction is asked for
    corrected = world.cli("requeue", run_id, "--set", "3.status=open", "--timeout", "90")
    from saga.cli.escalations import corrections_supported

    if corrections_supported():
        assert corrected.returncode == 1, corrected.stderr  # taken; the tickets are still down
    else:
        # Then this version refuses it as a usage error, and changes nothing
        assert corrected.returncode == 2
        assert "not supported by this version" in corrected.stderr
        assert world.saga.picture(run_id).state is RunState.ESCALATED

    # When the ticket system is fixed and the run requeued
    systems.set_down("tickets", False)
    systems.clear_switches()
    done = world.cli("requeue", run_id, "--json", "--by", "ops@example", "--timeout", "90")

    # Then it compensates (exit 0), the ticket is restored, no escalation stays open
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert (result["state"], result["requeued"], result["by"]) == ("compensated", 1, "ops@example")
    assert systems.get_ticket(TICKET)["status"] == "open"
    assert world.saga.records.escalations(run_id, open_only=True) == []
    # and the run no longer says its compensation failed: it is back to what set it failing
    [row] = [r for r in world.cli_json("runs")["runs"] if r["run_id"] == run_id]
    assert (row["state"], row["reason"]) == ("compensated", "step 4 failed")
    assert world.saga.records.run(run_id).reason == "step 4 failed"
    # and the run's timeline now shows every undo done
    shown = world.cli("show", run_id)
    assert "→ run ends compensated" in shown.stdout
    assert "✗" not in shown.stdout.split("UNWIND")[1]


def test_resolve_closes_an_escalation_past_the_pivot_with_a_note(world: World) -> None:
    # Given a run that escalated past its pivot (nothing to requeue)
    run_id = escalate_after_the_pivot(world)
    systems.clear_switches()
    escalation_id = f"{run_id}:0"
    package = world.cli_json("escalation", "show", escalation_id)
    assert package["why"]["kind"] == "after_pivot"
    assert package["commands"]["requeue"] is None

    # When it is requeued: nothing to requeue (exit 1)
    assert world.cli("requeue", run_id).returncode == 1

    # When a person resolves it, saying what they did
    note = "credit kept; partner told by phone"
    done = world.cli("resolve", escalation_id, "--note", note, "--by", "ada")

    # Then it is closed with the note and who, and is no longer listed as open
    assert done.returncode == 0, done.stderr
    [record] = world.saga.records.escalations(run_id)
    assert record.resolved is True
    assert (record.resolved_by, record.resolution) == ("ada", note)
    assert record.resolved_at is not None
    open_ids = [e["escalation_id"] for e in world.cli_json("escalations")["escalations"]]
    assert escalation_id not in open_ids
    closed = world.cli_json("escalation", "show", escalation_id)
    assert (closed["open"], closed["commands"]["resolve"]) == (False, None)
    # and resolving it again is a bad state, an empty note a usage error
    assert world.cli("resolve", escalation_id, "--note", "again").returncode == 1
    assert world.cli("resolve", escalation_id, "--note", " ").returncode == 2


@SQLITE_ONLY
def test_unknown_runs_and_escalations_exit_3(world: World) -> None:
    for args in (
        ["show", "no-such-run"],
        ["escalation", "show", "no-such-run:0"],
        ["requeue", "no-such-run"],
        ["resolve", "no-such-run:0", "--note", "n"],
    ):
        done = world.cli(*args)
        assert done.returncode == 3, (args, done.stdout, done.stderr)
    assert world.cli("show", "not a run id").returncode == 2


@SQLITE_ONLY
def test_reap_runs_one_pass(world: World) -> None:
    done = world.cli("reap", "--json")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["broken"] == []


# -- doctor ------------------------------------------------------------------------------------


@pytest.fixture
def beat(world: World) -> Iterator[subprocess.Popen[bytes]]:
    """``celery beat`` scheduling the reaper every second; stopped by its process group."""
    command = [sys.executable, "-m", "celery", "-A", "tasks.app", "beat", "--loglevel", "INFO"]
    command += ["-s", str(world.data / "beat-schedule"), "--logfile", str(world.data / "beat.log")]
    process = subprocess.Popen(
        command,
        env={**os.environ, **world.env},
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        yield process
    finally:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(10)


@SQLITE_ONLY
def test_doctor_finds_a_healthy_deployment(world: World, beat: Any) -> None:
    # Given beat has had the reaper run at least once
    wait_until(world.saga.store.last_reaper_pass, timeout=90, what="a reaper pass")

    # When the deployment is checked
    done = world.cli("doctor", "--json")

    # Then nothing fails (warnings allowed) and it exits 0
    report = json.loads(done.stdout)
    failed = [c for c in report["checks"] if c["status"] == "fail"]
    assert (done.returncode, failed) == (0, []), done.stderr
    statuses = {c["name"]: c["status"] for c in report["checks"]}
    for name in ("redis", "redis persistence", "redis eviction", "broker", "database"):
        assert statuses[name] == "ok", name
    assert statuses["workers"] == statuses["beat"] == statuses["guard"] == "ok"
    # and the human table says the same
    assert world.cli("doctor").returncode == 0


@SQLITE_ONLY
def test_doctor_without_beat_or_with_an_evicting_redis_exits_1(world: World) -> None:
    # Given no reaper pass was ever recorded on a fresh database of the same Redis
    url = world.env["SAGA_REDIS_URL"].rsplit("/", 1)[0] + "/5"
    client = redis_client(url)
    client.flushdb()
    policy = client.config_get("maxmemory-policy")["maxmemory-policy"]
    try:
        client.config_set("maxmemory-policy", "allkeys-lru")
        done = world.cli("doctor", "--json", SAGA_REDIS_URL=url, SAGA_BROKER_URL=url)
    finally:
        client.config_set("maxmemory-policy", policy)
        client.close()

    # Then beat and eviction are problems, not outages: exit 1
    report = json.loads(done.stdout)
    statuses = {c["name"]: c["status"] for c in report["checks"]}
    assert done.returncode == 1, done.stderr
    assert statuses["beat"] == statuses["redis eviction"] == "fail"


def test_doctor_with_redis_unreachable_exits_4(tmp_path: Path) -> None:
    # Given nothing listens where Redis should be
    url = f"redis://127.0.0.1:{free_port()}/0"
    env = {
        **os.environ,
        "SAGA_REDIS_URL": url,
        "SAGA_BROKER_URL": url,
        "SAGA_RESULT_BACKEND": url,
        "SAGA_DATABASE_URL": f"sqlite:///{tmp_path / 'saga.db'}",
        "PYTHONPATH": str(ROOT),
    }

    # When the deployment is checked
    done = subprocess.run(
        [SAGA, "doctor"], env=env, cwd=ROOT, capture_output=True, text=True, timeout=120
    )

    # Then it says which service does not answer, and exits 4
    assert done.returncode == 4, done.stdout + done.stderr
    assert "does not answer" in done.stdout
    assert "redis, broker" in done.stderr


@SQLITE_ONLY
def test_doctor_sees_every_worker_of_a_host_even_under_one_name(world: World) -> None:
    # Given a tool worker and a turn worker on this host, started under the same node name
    # (what `celery worker` gives both without -n), on a broker of their own
    url = world.env["SAGA_REDIS_URL"].rsplit("/", 1)[0] + "/7"
    env = {**world.env, "SAGA_REDIS_URL": url, "SAGA_BROKER_URL": url, "SAGA_RESULT_BACKEND": url}
    same = ["-n", f"celery-{uuid.uuid4().hex[:6]}@%h"]
    tools = WorkerProcess(
        "tasks.app", env=env, cwd=ROOT, extra_args=["-Q", "celery", *same], concurrency=1
    )
    turns = WorkerProcess(
        "tasks.app",
        env=env,
        cwd=ROOT,
        pool="threads",
        extra_args=["-Q", "saga.turns", *same],
        concurrency=2,
    )
    with tools, turns:
        # When the deployment is checked
        done = world.cli("doctor", "--json", **env)

    # Then both queues count as served, and the shared name is named as the problem
    report = json.loads(done.stdout)
    checks = {c["name"]: c for c in report["checks"]}
    assert "tool queue" not in checks and "turn queue" not in checks, checks
    assert checks["workers"]["detail"].startswith("2 online")
    assert checks["worker names"]["status"] == "warn"
    assert "give each its own -n" in checks["worker names"]["detail"]
    redis_client(url).flushdb()


@SQLITE_ONLY
def test_the_indexes_are_shown_resharded_and_a_process_sharding_otherwise_refused(
    world: World,
) -> None:
    # Given runs indexed in the store's one (unsharded) shard, and a reaper pass just now
    runs = [world.saga.start_run() for _ in range(3)]
    shown = world.cli_json("indexes")
    assert (shown["recorded"], shown["configured"]) == (1, 1)
    assert sum(shown["sizes"]["created"]) >= 3
    world.saga.store.note_reaper_pass()

    # When a process configured for 4 shards looks, and the indexes are resharded to 4
    refused = world.cli("indexes", SAGA_INDEX_SHARDS="4")
    live = world.cli("indexes", "reshard", "--shards", "4")
    moved = world.cli("indexes", "reshard", "--shards", "4", "--force", "--json")

    # Then it is told to reshard; a reshard beside a live reaper is refused; with --force the
    # entries move, the 4-shard process agrees, and the old count is refused in turn
    assert refused.returncode == 1 and "configured for 4 shard(s)" in refused.stderr
    assert live.returncode == 1 and "beat and a worker still run" in live.stderr
    assert moved.returncode == 0, moved.stderr
    found = json.loads(moved.stdout)
    assert (found["from"], found["to"]) == (1, 4) and found["moved"]["created"] >= 3
    assert json.loads(world.cli("indexes", "--json", SAGA_INDEX_SHARDS="4").stdout)["recorded"] == 4
    assert world.cli("indexes").returncode == 1
    back = world.cli("indexes", "reshard", "--shards", "1", "--force")
    assert back.returncode == 0, back.stderr
    assert {r.run_id for r in runs} <= set(world.saga.store.active_runs())
    for run in runs:
        run.abort("not driven by this test")
