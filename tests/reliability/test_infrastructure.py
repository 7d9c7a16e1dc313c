"""The infrastructure under the saga: Redis persistence and outages, poison messages, the
start-up guard, ACL and TLS, oversized payloads.

Each test owns its Redis and workers (see conftest). Effects are counted in the demo systems.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import kombu
import pytest
import redis
from celery import Celery

from saga import (
    ConfigurationError,
    PayloadError,
    RetryPolicy,
    Run,
    RunPicture,
    RunState,
    Saga,
    Settings,
    StepFailedError,
    StepHandle,
    StepState,
    StoreUnavailableError,
    ToolResultError,
    UnknownRunError,
    payload,
)
from saga.guard import configuration_problems
from saga.stack import RunStore
from saga.testing import RedisServer, WorkerProcess, free_port
from tasks import systems
from tasks.tools import tools as demo_tools
from tests.conftest import ROOT
from tests.integration.helpers import CREDIT, EMAIL, ORDER, TICKET, demo_steps, wait_until
from tests.reliability.conftest import Private

pytestmark = pytest.mark.timeout(120)

AOF_ALWAYS = ("--appendonly", "yes", "--appendfsync", "always")


def credits() -> list[dict[str, Any]]:
    return [e for e in systems.ledger(ORDER) if e["kind"] == "credit"]


def reversals() -> list[dict[str, Any]]:
    return [e for e in systems.ledger(ORDER) if e["kind"] == "reversal"]


ENDED = (RunState.COMPLETED, RunState.COMPENSATED, RunState.ESCALATED)


def reply(run: Any) -> Any:
    return run.call("send_reply", to=EMAIL, subject="Your credit", body="We credited $2,500.")


def finish_or_wait(run: Run, credit: StepHandle, timeout: float = 60) -> RunPicture:
    """Settle the credit step; if it succeeded, run the rest and complete, else await the end."""
    try:
        credit.result(timeout=timeout)
    except StepFailedError:
        return run.wait(timeout=timeout)
    run.call("set_ticket_status", ticket_id=TICKET, status="pending_refund").result(timeout=30)
    reply(run).result(timeout=30)
    return run.finish(timeout=30)


def drained(env: Private, timeout: float = 30) -> None:
    """Wait until the broker holds no message, queued or unacknowledged."""
    client = env.saga.store.client

    def empty() -> bool:
        return client.llen("celery") == 0 and client.hlen("unacked") == 0

    wait_until(empty, timeout=timeout, what="the broker queue to drain")


# -- 1. AOF durability -----------------------------------------------------------------------


@pytest.mark.parametrize("fsync", ["always", "everysec"])
def test_acknowledged_undo_survives_a_redis_crash_with_aof(
    private: Callable[..., Private], fsync: str
) -> None:
    """With AOF on, a pushed undo survives SIGKILL of Redis and the run still unwinds once."""
    # SIGKILL ends the process, not the kernel: what Redis wrote is in the page cache either
    # way. Only an OS crash or power cut tells 'always' from 'everysec' (docs/durability.md).
    env = private(redis_args=("--appendonly", "yes", "--appendfsync", fsync))
    env.worker()
    run = env.saga.start_run()
    assert len(demo_steps(run, upto=3)) == 3
    before = env.saga.picture(run.run_id)
    assert [e["tool"] for e in before.stack] == ["reverse_credit", "set_ticket_status"]

    env.restart_redis()

    after = env.saga.picture(run.run_id)
    assert after.state is RunState.RUNNING and after.pivot_step is None
    assert after.stack == before.stack
    assert [(s.tool, s.state.value) for s in after.steps] == [
        (s.tool, s.state.value) for s in before.steps
    ]
    systems.set_down("mail")
    with pytest.raises(StepFailedError):
        reply(run).result(timeout=40)
    picture = run.wait(timeout=40)
    assert picture.state is RunState.COMPENSATED
    assert [e["amount_cents"] for e in credits()] == [CREDIT]
    assert [e["amount_cents"] for e in reversals()] == [-CREDIT]
    assert systems.get_ticket(TICKET)["status"] == "open"
    assert systems.outbox() == []


def test_without_aof_a_redis_crash_loses_the_run_and_its_undo(
    private: Callable[..., Private],
) -> None:
    """Without AOF, SIGKILL of Redis loses the run: the credit stays with no undo anywhere."""
    env = private(redis_args=("--appendonly", "no"))
    env.worker()
    run = env.saga.start_run()
    assert len(demo_steps(run, upto=2)) == 2
    assert [e["tool"] for e in env.saga.picture(run.run_id).stack] == ["reverse_credit"]

    env.restart_redis()

    with pytest.raises(UnknownRunError):
        env.saga.picture(run.run_id)
    assert env.saga.store.active_runs() == []  # the reaper cannot find it either
    assert env.saga.reap().examined == 0
    assert [e["amount_cents"] for e in credits()] == [CREDIT]  # the effect is real
    assert env.saga.records.run(run.run_id) is None  # and recorded nowhere else


# -- 2. Redis killed and restarted while a step runs ------------------------------------------


def test_redis_restarted_while_a_step_runs_ends_the_run_once(
    private: Callable[..., Private],
) -> None:
    """Redis SIGKILLed and restarted (AOF) mid-step: the run ends once, with one credit at most."""
    env = private(redis_args=AOF_ALWAYS)
    worker = env.worker()
    env.faults.delay("issue_credit", 2)
    run = env.saga.start_run()
    run.call("get_order", order_id=ORDER).result(timeout=20)
    credit = run.call("issue_credit", order_id=ORDER, amount_cents=CREDIT, memo="late")
    wait_until(lambda: credit.state() is StepState.RUNNING, timeout=20, what="step 2 running")

    env.restart_redis()  # while the step sleeps before its effect

    # Then the step settles once the worker has reconnected, and the run ends exactly once
    picture = finish_or_wait(run, credit)
    assert picture.state in ENDED, picture
    drained(env)  # any redelivered copy of the step has been replayed, not re-run
    assert len(credits()) <= 1
    assert len(reversals()) == (len(credits()) if picture.state is RunState.COMPENSATED else 0)
    if picture.state is RunState.COMPLETED:
        assert [e["amount_cents"] for e in credits()] == [CREDIT]
        assert len(systems.outbox()) == 1
    assert "Connection to broker lost" in worker.log()


# -- 3. Redis unreachable when the undo is pushed ----------------------------------------------

#: No fault injection in the worker, so the push is its first Redis call after the effect, and
#: a time limit above Celery's blocking reconnect (2 + 4 + 6 s): see docs/durability.md.
OUTAGE_WORKER = {
    "SAGA_TESTING_FAULTS": "0",
    "SAGA_TASK_TIME_LIMIT": "20",
    "SAGA_VISIBILITY_TIMEOUT": "30",
}


def _credit_while_redis_is_down(env: Private) -> tuple[Run, StepHandle]:
    """Step 2 (the credit) applies its effect while Redis is SIGKILLed; Redis returns 8 s later.

    The delay is the billing system's own (a slow service, kept in SQLite, not in Redis), and
    8 s is longer than redis-py's own retries (10, backoff capped at 1 s) and Celery's retry
    publish, so the push really fails.
    """
    env.env = {**env.env, **OUTAGE_WORKER}
    env.worker()
    systems.set_delay("billing", 2)
    run = env.saga.start_run(deadline=5)
    run.call("get_order", order_id=ORDER).result(timeout=20)
    credit = run.call("issue_credit", order_id=ORDER, amount_cents=CREDIT, memo="late")
    wait_until(lambda: credit.state() is StepState.RUNNING, timeout=20, what="step 2 running")
    env.redis.kill()
    wait_until(credits, timeout=20, what="the credit, issued while Redis is away")
    time.sleep(8)
    env.redis.start()
    systems.set_delay("billing", 0)
    return run, credit


def test_push_with_redis_down_is_never_reported_successful(
    private: Callable[..., Private],
) -> None:
    """Redis down between effect and push: never succeeded without its undo; then undone once."""
    env = private(redis_args=AOF_ALWAYS)
    run, _ = _credit_while_redis_is_down(env)
    seen: list[RunPicture] = []

    def settled() -> bool:
        seen.append(env.saga.picture(run.run_id))
        return seen[-1].step(2).state is not StepState.RUNNING

    try:
        wait_until(settled, timeout=20, what="the step to settle by itself")
    except AssertionError:
        # Stranded past the worker's patience: the reaper reconciles it by its lookup
        report = env.saga.reap()
        assert report.in_doubt == [(run.run_id, 2, "happened")]
    if env.saga.picture(run.run_id).state is RunState.RUNNING:
        run.abort("end of test")
    seen.append(run.wait(timeout=30))

    for picture in seen:
        if picture.step(2).state is StepState.SUCCEEDED:
            assert 2 in {c.step for c in picture.compensations}, picture
    assert seen[-1].state is RunState.COMPENSATED
    assert [e["amount_cents"] for e in systems.ledger(ORDER)] == [CREDIT, -CREDIT]


def test_push_with_redis_down_is_retried_once_redis_returns(
    private: Callable[..., Private],
) -> None:
    """Once Redis is back, the step records its outcome and undo by itself, without the reaper."""
    env = private(redis_args=AOF_ALWAYS)
    run, credit = _credit_while_redis_is_down(env)
    wait_until(lambda: credit.state() is not StepState.RUNNING, timeout=30, what="the step")
    picture = env.saga.picture(run.run_id)
    assert picture.step(2).state is StepState.SUCCEEDED
    assert [e["tool"] for e in picture.stack] == ["reverse_credit"]


def test_waiting_on_a_step_during_an_outage_raises_store_unavailable(
    private: Callable[..., Private],
) -> None:
    """An agent waiting on a step while Redis is away gets StoreUnavailableError, retryable."""
    env = private()
    run = env.saga.start_run()
    handle = run.call("get_order", order_id=ORDER)  # no worker: it stays dispatched
    env.redis.kill()
    with pytest.raises(StoreUnavailableError) as away:
        handle.result(timeout=1)
    assert away.value.retryable
    with pytest.raises(StoreUnavailableError):
        run.picture()
    with pytest.raises(StoreUnavailableError):
        run.call("get_order", order_id=ORDER)


# -- 4. Poison messages on the broker ----------------------------------------------------------


class _Bomb:
    """Unpickling this creates a directory: proof that a worker ran pickle on a message."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.mkdir, (self.marker,))


def _publish(
    url: str,
    body: Any,
    headers: dict[str, Any],
    serializer: str | None = None,
    content_type: str | None = None,
) -> None:
    with kombu.Connection(url) as conn:
        producer = conn.Producer()
        options: dict[str, Any] = (
            {"serializer": serializer}
            if serializer
            else {"content_type": content_type, "content_encoding": "utf-8"}
        )
        producer.publish(
            body,
            routing_key="celery",
            exchange="",
            headers=headers,
            declare=[kombu.Queue("celery")],
            retry=False,
            **options,
        )


def test_poison_messages_are_refused_and_the_worker_carries_on(
    private: Callable[..., Private], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Pickle and undecodable messages on the queue are refused; the next run is unaffected."""
    env = private()
    worker = env.worker()
    # A step reserved by the dispatcher whose message never left: the pickle copy stands in
    victim = env.saga.start_run(deadline=1)
    sent: list[dict[str, Any]] = []
    with monkeypatch.context() as patch:
        patch.setattr(env.saga.app, "send_task", lambda name, **kw: sent.append(kw))
        held = victim.call("issue_credit", order_id=ORDER, amount_cents=CREDIT, memo="poison")
    step, args = held.step, sent[0]["kwargs"]["args"]
    marker = tmp_path / "pickle-ran"
    task_id = f"{victim.run_id}:{step}"
    headers, _props, body, _sent = env.saga.app.amqp.as_task_v2(
        task_id,
        "tools.issue_credit",
        kwargs={"run_id": victim.run_id, "step": step, "args": args, "x": _Bomb(marker)},
    )
    _publish(env.url + "/0", body, headers, serializer="pickle")
    headers2, _p, _b, _s = env.saga.app.amqp.as_task_v2("garbage-1", "tools.issue_credit")
    _publish(env.url + "/0", b"{not json at all\xff", headers2, content_type="application/json")

    # Then a normal run through the same worker is unaffected
    run = env.saga.start_run()
    assert len(demo_steps(run)) == 4
    assert run.finish(timeout=30).state is RunState.COMPLETED
    drained(env)  # both poison messages were discarded, not left to loop
    log = worker.log()
    assert (
        "Received invalid task message: Refusing to deserialize untrusted content of type "
        "pickle (application/x-python-serialize)" in log
    )
    assert "Can't decode message body: DecodeError(" in log
    assert not marker.exists()  # the pickle was never loaded
    assert held.state() is StepState.DISPATCHED  # the pickle copy never ran the step
    assert [e["idempotency_key"] for e in credits()] == [f"{run.run_id}:2"]
    # The step its message never reached is sent again by the reaper, from the store, and
    # runs once; its run, whose caller is gone, is abandoned and the credit reversed
    resent = wait_until(lambda: env.saga.reap().resent, timeout=15, what="reap")
    assert resent == [(victim.run_id, step)]
    assert held.result(timeout=30)["credit_id"]
    wait_until(lambda: env.saga.reap().abandoned, timeout=15, what="abandon")
    assert victim.wait(timeout=30).state is RunState.COMPENSATED
    assert [e["idempotency_key"] for e in credits()] == [f"{run.run_id}:2", held.idempotency_key]
    assert [e["idempotency_key"] for e in reversals()] == [f"{held.idempotency_key}:undo"]


# -- 5. The start-up guard ---------------------------------------------------------------------


def _exit_of_worker(env: dict[str, str], timeout: float = 60) -> tuple[int, str]:
    """Run a worker that is expected to refuse to start: its exit status and stderr."""
    command = [sys.executable, "-m", "celery", "-A", "tasks.app", "worker", "-P", "solo"]
    command += ["--loglevel", "INFO", "--without-gossip", "--without-mingle"]
    process = subprocess.Popen(
        command,
        env={**os.environ, **env},
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    try:
        _, err = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.communicate(timeout=10)
        raise AssertionError(f"the worker did not exit within {timeout}s") from None
    return process.returncode, err.decode(errors="replace")


REFUSAL = "saga: refusing to start the worker:"
SHORT_VISIBILITY = (
    "task_time_limit (5s) is not below the visibility timeout (2s): Redis would hand the task "
    "to a second worker while the first still has it"
)


def test_guard_refuses_a_visibility_timeout_below_the_time_limit(
    private: Callable[..., Private],
) -> None:
    """A visibility timeout below the task time limit: the worker exits 78, saying why."""
    env = private()
    bad = {**env.env, "SAGA_VISIBILITY_TIMEOUT": "2", "SAGA_TASK_TIME_LIMIT": "5"}
    with pytest.raises(RuntimeError, match="did not become ready"):
        WorkerProcess("tasks.app", env=bad, cwd=ROOT, logfile=env.data / "bad.log").start(30)

    status, stderr = _exit_of_worker(bad)
    assert status == 78  # EX_CONFIG
    assert REFUSAL in stderr and SHORT_VISIBILITY in stderr
    assert "task_soft_time_limit (4s) is not below the visibility timeout (2s)" in stderr


def test_guard_refusal_is_written_to_the_worker_log_file(private: Callable[..., Private]) -> None:
    """The refusal is in the worker's --logfile, where an operator (and WorkerProcess) looks."""
    env = private()
    bad = {**env.env, "SAGA_VISIBILITY_TIMEOUT": "2", "SAGA_TASK_TIME_LIMIT": "5"}
    worker = WorkerProcess("tasks.app", env=bad, cwd=ROOT, logfile=env.data / "bad.log")
    with pytest.raises(RuntimeError) as refused:
        worker.start(timeout=30)
    assert REFUSAL in str(refused.value) and SHORT_VISIBILITY in str(refused.value)


def test_guard_refuses_an_evicting_redis(private: Callable[..., Private]) -> None:
    """A Redis with maxmemory-policy allkeys-lru: the worker exits 78, naming the policy."""
    env = private(redis_args=("--maxmemory-policy", "allkeys-lru"))
    status, stderr = _exit_of_worker(env.env)
    assert status == 78
    assert REFUSAL in stderr
    assert "Redis maxmemory-policy is allkeys-lru: it may evict the compensation stack" in stderr


def test_guard_refuses_to_start_when_the_stack_store_is_unreachable(
    private: Callable[..., Private],
) -> None:
    """A worker whose stack Redis does not answer refuses to start instead of running unchecked."""
    env = private()
    bad = {**env.env, "SAGA_REDIS_URL": f"redis://127.0.0.1:{free_port()}/0"}
    worker = WorkerProcess("tasks.app", env=bad, cwd=ROOT, logfile=env.data / "bad.log")
    try:
        worker.start(timeout=30)
        started = True
    except RuntimeError:
        started = False
    finally:
        worker.stop()
    assert not started, "the worker became ready with no stack store to check"


GOOD_CONF: dict[str, Any] = {
    "broker_url": "redis://127.0.0.1:6379/0",
    "accept_content": ["json"],
    "result_accept_content": ["json"],
    "task_serializer": "json",
    "result_serializer": "json",
    "task_acks_late": True,
    "task_time_limit": 300,
    "task_soft_time_limit": 270,
    "broker_transport_options": {"visibility_timeout": 1200},
}
POLICIES = {"get_order": RetryPolicy(attempts=3, backoff=1, backoff_max=60)}


@pytest.mark.parametrize(
    ("change", "problem"),
    [
        (
            {"accept_content": ["json", "pickle"]},
            "accept_content accepts pickle: only json is safe",
        ),
        (
            {"accept_content": ["application/json", "application/x-python-serialize"]},
            "accept_content accepts application/x-python-serialize",
        ),
        ({"result_accept_content": ["json", "yaml"]}, "result_accept_content accepts yaml"),
        ({"task_serializer": "pickle"}, "task_serializer is 'pickle': it must be 'json'"),
        ({"result_serializer": "msgpack"}, "result_serializer is 'msgpack'"),
        ({"task_acks_late": False}, "task_acks_late is off"),
        ({"task_time_limit": 1200}, "task_time_limit (1200s) is not below the visibility timeout"),
        ({"broker_transport_options": {}}, None),  # Celery's default visibility: 3600 s
        (
            {"broker_transport_options": {}, "task_time_limit": 3600},
            "task_time_limit (3600s) is not below the visibility timeout (3600s)",
        ),
        (
            {
                "broker_url": "rediss://h:6380/0?ssl_cert_reqs=required",
                "task_soft_time_limit": 1500,
            },
            "task_soft_time_limit (1500s) is not below the visibility timeout (1200s)",
        ),
        (
            {"broker_url": "rediss://h:6380/0"},
            "broker_url is rediss:// without certificate checks",
        ),
        ({"broker_url": "amqp://guest@localhost//", "broker_transport_options": {}}, None),
    ],
    ids=lambda value: str(value)[:40] if isinstance(value, dict) else None,
)
def test_configuration_problems_names_each_unsafe_setting(
    change: dict[str, Any], problem: str | None
) -> None:
    """Each unsafe setting alone is named by configuration_problems; safe variants pass."""
    problems = configuration_problems({**GOOD_CONF, **change}, POLICIES, [])
    if problem is None:
        assert problems == []
    else:
        assert len(problems) == 1 and problem in problems[0], problems


def test_configuration_problems_counts_the_longest_retry_delay() -> None:
    """A tool whose retry delay plus the time limit reaches the visibility timeout is named."""
    slow = {**POLICIES, "issue_credit": RetryPolicy(attempts=2, backoff=900, backoff_max=1200)}
    problems = configuration_problems(GOOD_CONF, slow, [])
    assert problems == [
        "tool issue_credit: the longest retry delay (900s) plus task_time_limit (300s) plus a 1s "
        "margin is not below the visibility timeout (1200s): a retried step could run on two "
        "workers at once; shorten the tool's RetryPolicy.backoff_max or raise the visibility "
        "timeout"
    ]


def test_good_configurations_pass_the_guard(private: Callable[..., Private]) -> None:
    """celeryconfig's defaults and the test app against a noeviction Redis raise no problem."""
    import celeryconfig

    env = private()
    policies = {t.name: t.retry for t in env.saga.registry}
    module = {k: v for k, v in vars(celeryconfig).items() if not k.startswith("_")}
    assert configuration_problems(module, policies, [env.saga.store.client]) == []
    assert configuration_problems(env.saga.app.conf, policies, [env.saga.store.client]) == []
    assert configuration_problems(GOOD_CONF, POLICIES, []) == []


@pytest.mark.parametrize(
    "policy", ["allkeys-lru", "volatile-lru", "allkeys-random", "volatile-ttl"]
)
def test_every_evicting_policy_is_a_problem(private: Callable[..., Private], policy: str) -> None:
    """Any maxmemory-policy but noeviction is refused, read from the live Redis."""
    env = private()
    client = env.saga.store.client
    client.config_set("maxmemory-policy", policy)
    assert configuration_problems(GOOD_CONF, POLICIES, [client]) == [
        f"Redis maxmemory-policy is {policy}: it may evict the compensation stack"
    ]
    client.config_set("maxmemory-policy", "noeviction")
    assert configuration_problems(GOOD_CONF, POLICIES, [client]) == []


def test_guard_warns_about_a_redis_without_aof(
    private: Callable[..., Private], caplog: pytest.LogCaptureFixture
) -> None:
    """A stack Redis without appendonly is named in a warning (fine for development only)."""
    env = private(redis_args=("--appendonly", "no"))
    with caplog.at_level("WARNING", logger="saga.guard"):
        problems = configuration_problems(GOOD_CONF, POLICIES, [env.saga.store.client])
    assert problems == []
    assert "appendonly no" in caplog.text


# -- 6. ACL and TLS ----------------------------------------------------------------------------

ACL_ARGS = ("--user", "saga", "on", ">s3cret", "~*", "&*", "+@all", "--user", "default", "off")


class _AclRedis(RedisServer):
    """A redis-server whose default user is off: its readiness ping must authenticate."""

    @property
    def url(self) -> str:
        return f"redis://saga:s3cret@127.0.0.1:{self.port}"


class _TlsRedis(RedisServer):
    """A redis-server listening on TLS only (``--port 0``); it pings with the test CA."""

    ca: Path

    @property
    def url(self) -> str:
        return f"rediss://127.0.0.1:{self.port}?ssl_cert_reqs=required&ssl_ca_certs={self.ca}"


@dataclass
class Standalone:
    """A saga and workers on a Redis the test started itself (credentials or TLS in the URL)."""

    saga: Saga
    env: dict[str, str]
    data: Path
    workers: list[WorkerProcess] = field(default_factory=list)

    def worker(self, timeout: float = 30, **env: str) -> WorkerProcess:
        process = WorkerProcess(
            "tasks.app",
            env={**self.env, **env},
            concurrency=1,
            cwd=ROOT,
            logfile=self.data / f"worker-{len(self.workers)}.log",
        )
        self.workers.append(process)
        return process.start(timeout)


@pytest.fixture
def standalone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[Callable[..., Standalone]]:
    """Factory: ``standalone(server, url, **redis_options)``; it owns and stops the server."""
    made: list[Standalone] = []
    servers: list[RedisServer] = []

    def make(server: RedisServer, url: str, **redis_options: Any) -> Standalone:
        servers.append(server)
        data = tmp_path / f"standalone-{len(made)}"
        data.mkdir()
        env = {
            "SAGA_REDIS_URL": url,
            "SAGA_BROKER_URL": url,
            "SAGA_RESULT_BACKEND": url,
            "SAGA_DEMO_DATA": str(data),
            "SAGA_DATABASE_URL": f"sqlite:///{data / 'saga.db'}",
            "SAGA_VISIBILITY_TIMEOUT": "8",  # the time limit, a retry, the guard's margin
            "SAGA_TASK_TIME_LIMIT": "5",
            "SAGA_TESTING_FAULTS": "0",
            "PYTHONPATH": str(ROOT),
        }
        for key, value in env.items():
            monkeypatch.setenv(key, value)
        app = Celery("infrastructure")
        app.config_from_object("celeryconfig")
        app.conf.update(broker_url=url, result_backend=url)
        settings = Settings(
            redis_url=url, database_url=env["SAGA_DATABASE_URL"], redis_options=redis_options
        )
        own = Standalone(Saga(app, demo_tools, settings), env, data)
        systems.reset()
        made.append(own)
        return own

    yield make

    for own in made:
        for process in own.workers:
            process.stop()
        own.saga.store.client.close()
        if own.saga.core._records is not None:
            own.saga.records.dispose()
    for server in servers:
        server.stop()
    systems.dispose_engines()


def test_acl_user_runs_a_whole_run_and_bad_credentials_are_refused(
    standalone: Callable[..., Standalone], tmp_path: Path
) -> None:
    """With ACLs (default user off) a full run works; a wrong password is a clear error."""
    server = _AclRedis(*ACL_ARGS, directory=tmp_path / "redis").start()
    good = f"redis://saga:s3cret@127.0.0.1:{server.port}/0"
    own = standalone(server, good)
    own.worker()
    run = own.saga.start_run()
    assert len(demo_steps(run)) == 4
    assert run.finish(timeout=30).state is RunState.COMPLETED
    assert [e["amount_cents"] for e in credits()] == [CREDIT] and len(systems.outbox()) == 1

    # A wrong password, or none, is our ConfigurationError (not retryable), caused by
    # AuthenticationError
    anonymous = f"redis://127.0.0.1:{server.port}/0"
    for url, says in (
        (good.replace("s3cret", "wrong"), "invalid username-password pair"),
        (anonymous, "authenticated"),
    ):
        store = RunStore.from_url(url, 60)
        with pytest.raises(ConfigurationError, match=says) as refused:
            store.view(run.run_id)
        store.client.close()
        assert isinstance(refused.value.__cause__, redis.AuthenticationError)
        assert refused.value.retryable is False
    # A worker with a wrong password refuses to start; its log says why, never the password
    wrong = good.replace("s3cret", "wrong")
    with pytest.raises(RuntimeError, match="refused the credentials") as stuck:
        own.worker(
            timeout=8, SAGA_REDIS_URL=wrong, SAGA_BROKER_URL=wrong, SAGA_RESULT_BACKEND=wrong
        )
    assert "invalid username-password pair" in str(stuck.value)
    assert "wrong" not in str(stuck.value)
    assert "s3cret" not in own.workers[0].log()


def test_guard_cannot_read_the_eviction_policy_without_config_permission(
    standalone: Callable[..., Standalone], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """An ACL user without CONFIG: the guard cannot check eviction, passes and warns (by design)."""
    server = _AclRedis(*ACL_ARGS, "--maxmemory-policy", "allkeys-lru").start()
    own = standalone(server, f"redis://saga:s3cret@127.0.0.1:{server.port}/0")
    admin = own.saga.store.client
    admin.acl_setuser(
        "limited",
        enabled=True,
        passwords=["+pw"],
        keys=["*"],
        channels=["*"],
        commands=["+@all", "-@dangerous"],
    )
    limited = redis.Redis.from_url(f"redis://limited:pw@127.0.0.1:{server.port}/0")
    try:
        with caplog.at_level("WARNING", logger="saga.guard"):
            assert configuration_problems(GOOD_CONF, POLICIES, [limited]) == []
        assert "cannot read the Redis maxmemory-policy (CONFIG is not allowed)" in caplog.text
        assert configuration_problems(GOOD_CONF, POLICIES, [admin]) == [
            "Redis maxmemory-policy is allkeys-lru: it may evict the compensation stack"
        ]
    finally:
        limited.close()


def _openssl(*args: str | Path) -> None:
    subprocess.run(["openssl", *map(str, args)], check=True, capture_output=True, timeout=60)


def _certificates(folder: Path) -> dict[str, Path]:
    """A throwaway CA, a server certificate for IP 127.0.0.1 only, and an unrelated CA."""
    folder.mkdir()
    names = "ca.crt ca.key other.crt other.key server.crt server.key server.csr san.cnf"
    files = {name: folder / name for name in names.split()}
    for ca in ("ca", "other"):
        _openssl(
            *f"req -x509 -newkey rsa:2048 -nodes -days 2 -subj /CN=saga-test-{ca}".split(),
            *("-keyout", files[f"{ca}.key"], "-out", files[f"{ca}.crt"]),
        )
    _openssl(
        *["req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=127.0.0.1"],
        *("-keyout", files["server.key"], "-out", files["server.csr"]),
    )
    files["san.cnf"].write_text("subjectAltName=IP:127.0.0.1\n")
    _openssl(
        *("x509", "-req", "-days", "2", "-in", files["server.csr"], "-CAcreateserial"),
        *("-CA", files["ca.crt"], "-CAkey", files["ca.key"], "-extfile", files["san.cnf"]),
        *("-out", files["server.crt"]),
    )
    return files


def _tls_server(certs: dict[str, Path]) -> _TlsRedis:
    """Started on a TLS port only (``--port 0``), with the server certificate above."""
    port = free_port()
    server = _TlsRedis(
        *("--port", "0", "--tls-port", str(port), "--tls-auth-clients", "no"),
        *("--tls-cert-file", str(certs["server.crt"]), "--tls-key-file", str(certs["server.key"])),
        *("--tls-ca-cert-file", str(certs["ca.crt"])),
        port=port,
    )
    server.ca = certs["ca.crt"]
    return server.start()


def _verified_url(server: RedisServer, ca: Path) -> str:
    return f"rediss://127.0.0.1:{server.port}/0?ssl_cert_reqs=required&ssl_ca_certs={ca}"


def test_tls_store_checks_the_server_certificate(tmp_path: Path) -> None:
    """Over TLS the stack works with our CA and is refused without it, or for another name."""
    certs = _certificates(tmp_path / "tls")
    server = _tls_server(certs)
    port, ca = server.port, certs["ca.crt"]
    try:
        store = RunStore.from_url(_verified_url(server, ca), 60)
        assert store.create("tls-run", 60)
        store.client.close()
        # The same through Settings.redis_options-style keyword arguments
        store = RunStore.from_url(f"rediss://127.0.0.1:{port}/0", 60, ssl_ca_certs=str(ca))
        view = store.view("tls-run")
        assert view is not None and view.state is RunState.RUNNING
        store.client.close()

        refused = {
            f"rediss://127.0.0.1:{port}/0": "certificate verify failed",  # system CAs only
            f"rediss://127.0.0.1:{port}/0?ssl_ca_certs={certs['other.crt']}": "verify failed",
            f"rediss://localhost:{port}/0?ssl_ca_certs={ca}": "mismatch",  # not its name
            f"redis://127.0.0.1:{port}/0": None,  # plaintext to a TLS port
        }
        refused_says: dict[str, str | None] = refused
        for url, says in refused_says.items():
            store = RunStore.from_url(url, 60, socket_timeout=5)
            with pytest.raises(StoreUnavailableError, match=says):
                store.view("tls-run")
            store.client.close()
    finally:
        server.stop()


def test_tls_worker_runs_a_whole_run_with_the_ca_in_the_urls(
    standalone: Callable[..., Standalone], tmp_path: Path
) -> None:
    """Broker, result backend and stack over verified TLS, configured by URL only: a full run."""
    certs = _certificates(tmp_path / "tls")
    server = _tls_server(certs)
    url = _verified_url(server, certs["ca.crt"])
    own = standalone(server, url)
    worker = own.worker()
    run = own.saga.start_run()
    assert len(demo_steps(run)) == 4
    assert run.finish(timeout=30).state is RunState.COMPLETED
    assert [e["amount_cents"] for e in credits()] == [CREDIT] and len(systems.outbox()) == 1
    assert "Connected to saga-rediss://" in worker.log()  # TLS, saga's transport
    assert "insecure SSL" not in worker.log()


def test_worker_refuses_a_rediss_broker_without_certificate_checks(
    standalone: Callable[..., Standalone], tmp_path: Path
) -> None:
    """A rediss:// broker URL with no CA must not silently mean 'any certificate will do'."""
    certs = _certificates(tmp_path / "tls")
    server = _tls_server(certs)
    url = _verified_url(server, certs["ca.crt"])
    own = standalone(server, url)
    # The broker presents a certificate from a CA the worker was never given
    try:
        own.worker(timeout=10, SAGA_BROKER_URL=f"rediss://127.0.0.1:{server.port}/0")
        started = True
    except RuntimeError:
        started = False
    assert not started, "the worker became ready on a broker whose certificate it never checked"


# -- 7. Oversized payloads ---------------------------------------------------------------------

WORKER_LIMIT = 2000


def test_oversized_arguments_are_refused_before_dispatch(private: Callable[..., Private]) -> None:
    """Arguments over the dispatcher's limit raise PayloadError; nothing is reserved or sent."""
    env = private(extra_env={"SAGA_MAX_PAYLOAD_BYTES": str(WORKER_LIMIT)})
    env.worker()
    run = env.saga.start_run()
    limit = env.saga.settings.max_payload_bytes  # the in-process default: 256 KiB
    assert limit == 256 * 1024
    with pytest.raises(PayloadError, match=f"over the limit of {limit} bytes"):
        run.call("send_reply", to=EMAIL, subject="Big", body="x" * (limit + 1))
    assert env.saga.picture(run.run_id).steps == []
    assert env.saga.store.client.llen("celery") == 0

    # A dispatcher reading the same environment as the worker refuses at 2,000 bytes
    settings = Settings.from_env()
    assert settings.max_payload_bytes == WORKER_LIMIT
    app = Celery("infrastructure-limits")
    app.config_from_object("celeryconfig")
    app.conf.update(broker_url=env.url + "/0", result_backend=env.url + "/0")
    strict = Saga(app, demo_tools, replace(env.saga.settings, max_payload_bytes=WORKER_LIMIT))
    try:
        with pytest.raises(PayloadError, match=f"over the limit of {WORKER_LIMIT} bytes"):
            strict.run(run.run_id).call("send_reply", to=EMAIL, subject="Big", body="x" * 5000)
    finally:
        strict.store.client.close()
    assert env.saga.picture(run.run_id).steps == []
    assert systems.outbox() == []
    assert run.finish(timeout=10).state is RunState.COMPLETED


def test_the_limit_counts_utf8_bytes_not_characters() -> None:
    """payload.dumps takes exactly the limit in UTF-8 bytes and refuses one byte more."""
    assert payload.dumps("é" * 999, what="body", limit=2000) == '"' + "é" * 999 + '"'  # 2000 B
    with pytest.raises(PayloadError, match="body is 2002 bytes, over the limit of 2000 bytes"):
        payload.dumps("é" * 1000, what="body", limit=2000)


def _oversized_reply(env: Private) -> tuple[Run, ToolResultError]:
    """Steps 1-3, then a reply whose result (it echoes the subject) is over the worker's limit:
    the caller is told at once (``ToolResultError``)."""
    env.worker()
    run = env.saga.start_run()
    assert len(demo_steps(run, upto=3)) == 3
    subject = "s" * (WORKER_LIMIT + 100)  # small enough to send, too big to record
    reply = run.call("send_reply", to=EMAIL, subject=subject, body="hi")
    with pytest.raises(ToolResultError) as caught:
        reply.result(timeout=20)
    return run, caught.value


def test_oversized_result_of_an_irreversible_step_escalates(
    private: Callable[..., Private],
) -> None:
    """A result over the worker's limit: the mail went once, the run escalates, nothing lost."""
    env = private(extra_env={"SAGA_MAX_PAYLOAD_BYTES": str(WORKER_LIMIT)})
    run, error = _oversized_reply(env)
    problem = "result of send_reply is 2158 bytes, over the limit of 2000 bytes"
    assert (error.error, error.run_goes_on) == (problem, False)
    picture = run.wait(timeout=30)
    assert picture.state is RunState.ESCALATED and picture.pivot_step == 4
    assert picture.step(4).state is StepState.SUCCEEDED  # the effect happened: never "failed"
    assert len(systems.outbox()) == 1 and len(credits()) == 1 and reversals() == []
    [escalation] = env.saga.records.escalations(run.run_id)
    assert {s["step"] for s in escalation.not_undone} == {2, 3, 4}
    assert problem in str(escalation.steps_done)  # the person can find out why


def test_escalation_reason_names_the_oversized_result(private: Callable[..., Private]) -> None:
    """The escalation's reason says the result was too big to record, not that a step failed."""
    env = private(extra_env={"SAGA_MAX_PAYLOAD_BYTES": str(WORKER_LIMIT)})
    run, _ = _oversized_reply(env)
    assert run.wait(timeout=30).state is RunState.ESCALATED
    [escalation] = env.saga.records.escalations(run.run_id)
    assert escalation.reason == "failed after an irreversible step"
    assert "over the limit of 2000 bytes" in escalation.cause, escalation.cause


def test_oversized_result_of_a_reversible_step_unwinds(private: Callable[..., Private]) -> None:
    """A result over the worker's limit: the undo is still pushed and the run unwinds."""
    env = private(extra_env={"SAGA_MAX_PAYLOAD_BYTES": str(WORKER_LIMIT)})
    env.worker()
    run = env.saga.start_run()
    assert len(demo_steps(run, upto=2)) == 2
    status = "t" * (WORKER_LIMIT + 100)  # set_ticket_status echoes it in its result
    with pytest.raises(ToolResultError) as caught:
        run.call("set_ticket_status", ticket_id=TICKET, status=status).result(timeout=20)
    problem = "result of set_ticket_status is 2148 bytes, over the limit of 2000 bytes"
    assert caught.value.error == problem
    picture = run.wait(timeout=30)
    assert picture.state is RunState.COMPENSATED
    assert picture.reason == f"step 3 (set_ticket_status): {problem}"
    assert sorted(c.step for c in picture.compensations if c.state.value == "done") == [2, 3]
    assert systems.get_ticket(TICKET)["status"] == "open"
    assert [e["amount_cents"] for e in systems.ledger(ORDER)] == [CREDIT, -CREDIT]
