"""RabbitMQ as the broker: the demo on real workers, in a vhost of this module's own.

The machine's RabbitMQ (``SAGA_TEST_AMQP``, default guest on 127.0.0.1:5672) gets a vhost
``saga-test-<random>`` for this module, deleted at the end; the stack and the results stay on
a Redis database of the module's own. No ``SAGA_RESULT_BACKEND`` is set anywhere: the defaults
must send results to the stack's Redis by themselves.
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import Celery
from kombu import Connection

from saga import RunState, Saga, Settings
from saga.celery_amqp import amqp_settings
from saga.constants import TURN_QUEUE
from saga.guard import configuration_problems
from saga.retry import RetryPolicy
from saga.testing import Faults, WorkerProcess
from tasks import systems
from tests.conftest import (
    MACHINE_REDIS,
    READ_ENV_ONCE,
    ROOT,
    TEST_DB,
    forget_modules_read_env_once,
    rabbitmq_vhost,
    redis_url_with_db,
    service_missing,
)
from tests.integration.helpers import CREDIT, ORDER, demo_steps, wait_until

pytestmark = pytest.mark.timeout(90)

#: A database index of its own on the test Redis (in the session's block), flushed before and
#: after.
REDIS_DB = TEST_DB - 2
TIME_LIMIT = 10
REFUSAL = "saga: refusing to start the worker:"


@dataclass
class Rabbit:
    """Everything this module owns on RabbitMQ and Redis."""

    url: str
    vhost: str
    env: dict[str, str]
    saga: Saga
    faults: Faults
    data: Path

    def worker(self, concurrency: int = 2, name: str = "worker") -> WorkerProcess:
        process = WorkerProcess(
            "tasks.app",
            env=self.env,
            concurrency=concurrency,
            cwd=ROOT,
            logfile=self.data / f"{name}.log",
            extra_args=["-Q", "celery,saga.turns"],
        )
        return process.start(60)

    def connection(self) -> Connection:
        return Connection(self.url)


def _app(url: str, redis_url: str) -> Celery:
    app = Celery("rabbit")
    app.config_from_object("celeryconfig")
    app.conf.update(
        broker_url=url,
        result_backend=redis_url,
        task_time_limit=TIME_LIMIT,
        task_soft_time_limit=TIME_LIMIT - 1,
        result_backend_transport_options={},
        **amqp_settings(url, "quorum"),
    )
    return app


@pytest.fixture(scope="module")
def rabbit(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Rabbit]:
    with rabbitmq_vhost() as (vhost, url):
        # (the machine's plain Redis on every leg: the session's worker covers RabbitMQ with a
        # Sentinel store)
        redis_url = redis_url_with_db(MACHINE_REDIS, REDIS_DB)
        client = redis.Redis.from_url(redis_url)
        try:
            client.ping()
        except redis.RedisError as exc:
            service_missing(f"no Redis at {redis_url} ({exc})")
        client.flushdb()
        data = tmp_path_factory.mktemp("rabbit")
        env = {
            "SAGA_BROKER_URL": url,
            "SAGA_REDIS_URL": redis_url,
            "SAGA_DEMO_DATA": str(data),
            "SAGA_DATABASE_URL": f"sqlite:///{data / 'saga.db'}",
            "SAGA_TASK_TIME_LIMIT": str(TIME_LIMIT),
            "SAGA_TESTING_FAULTS": "1",
            "PYTHONPATH": str(ROOT),
        }
        saved = {k: os.environ.get(k) for k in [*env, "SAGA_RESULT_BACKEND"]}
        imported_before = {name for name in READ_ENV_ONCE if name in sys.modules}
        os.environ.pop("SAGA_RESULT_BACKEND", None)
        os.environ.update(env)
        from tasks.tools import tools

        settings = Settings(redis_url=redis_url, database_url=env["SAGA_DATABASE_URL"])
        saga = Saga(_app(url, redis_url), tools, settings)
        systems.reset()
        assert saga.faults is not None
        yield Rabbit(url, vhost, env, saga, Faults(saga.store.client), data)
        saga.store.client.close()
        if saga.core._records is not None:
            saga.records.dispose()
        systems.dispose_engines()
        client.flushdb()
        client.close()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        # (the Celery configuration imported under this vhost's variables must not outlive it)
        forget_modules_read_env_once(keep=imported_before)


@pytest.fixture(scope="module")
def worker(rabbit: Rabbit) -> Iterator[WorkerProcess]:
    process = rabbit.worker()
    yield process
    process.kill()


@pytest.fixture
def world(rabbit: Rabbit, worker: WorkerProcess) -> Iterator[Rabbit]:
    systems.reset()
    rabbit.faults.clear()
    yield rabbit
    systems.clear_switches()


# -- the defaults ----------------------------------------------------------------------------


@pytest.fixture
def fresh_defaults(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """``saga.celery_defaults`` imported again under the environment the test sets."""

    def load(**env: str) -> Any:
        for name in ("SAGA_RESULT_BACKEND", "SAGA_RABBITMQ_QUEUE_TYPE", "SAGA_REDIS_PASSWORD"):
            monkeypatch.delenv(name, raising=False)
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        sys.modules.pop("saga.celery_defaults", None)
        return importlib.import_module("saga.celery_defaults")

    yield load
    sys.modules.pop("saga.celery_defaults", None)


@pytest.mark.parametrize("scheme", ["amqp", "amqps", "pyamqp"])
def test_an_amqp_broker_sends_results_to_the_stacks_redis_on_quorum_queues(
    fresh_defaults: Any, scheme: str
) -> None:
    defaults = fresh_defaults(
        SAGA_BROKER_URL=f"{scheme}://u:p@rabbit/v",
        SAGA_REDIS_URL="redis://stack:6379/2",
        SAGA_REDIS_PASSWORD="secret",
    )
    assert defaults.broker_url == f"{scheme}://u:p@rabbit/v"  # no Redis password put in
    assert defaults.result_backend == "redis://:secret@stack:6379/2"
    assert defaults.broker_transport_options == {"confirm_publish": True}
    queues = {q.name: q for q in defaults.task_queues}
    assert set(queues) == {"celery", "saga.turns"}
    for queue in queues.values():
        assert queue.queue_arguments == {"x-queue-type": "quorum"}
        assert queue.exchange.type == "topic" and queue.durable
    assert defaults.task_create_missing_queue_type == "quorum"
    assert Settings.from_env().redis_url == "redis://:secret@stack:6379/2"


def test_the_store_never_falls_back_to_an_amqp_broker(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SAGA_BROKER_URL", "amqp://rabbit//")
    monkeypatch.delenv("SAGA_REDIS_URL", raising=False)
    monkeypatch.delenv("SAGA_REDIS_PASSWORD", raising=False)
    assert Settings.from_env().redis_url == "redis://localhost:6379/0"


def test_classic_is_the_opt_out_and_redis_keeps_its_settings(fresh_defaults: Any) -> None:
    classic = fresh_defaults(SAGA_BROKER_URL="amqp://rabbit//", SAGA_RABBITMQ_QUEUE_TYPE="classic")
    assert all(q.queue_arguments is None for q in classic.task_queues)
    on_redis = fresh_defaults(SAGA_BROKER_URL="redis://r:6379/0", SAGA_RESULT_BACKEND="")
    assert on_redis.task_queues is None and on_redis.task_default_exchange_type == "direct"
    assert on_redis.result_backend == "redis://r:6379/0"
    assert "visibility_timeout" in on_redis.broker_transport_options
    assert on_redis.task_create_missing_queue_type == "classic"


# -- the guard -------------------------------------------------------------------------------


def test_the_guard_refuses_a_consumer_timeout_below_the_longest_hold(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    conf = {
        "broker_url": "amqp://rabbit//",
        "accept_content": ["json"],
        "result_accept_content": ["json"],
        "task_serializer": "json",
        "result_serializer": "json",
        "task_acks_late": True,
        "task_time_limit": 300,
    }
    slow = {"slow_tool": RetryPolicy(attempts=2, backoff=600, backoff_max=600, jitter=False)}
    assert configuration_problems(conf, slow, []) == []  # RabbitMQ's default: 1800 s
    monkeypatch.setenv("SAGA_RABBITMQ_CONSUMER_TIMEOUT", "900")
    (problem,) = configuration_problems(conf, slow, [])
    assert problem.startswith("tool slow_tool: the longest retry delay (600s)")
    assert "consumer timeout (900s" in problem and "consumer_timeout = " in problem
    assert "rabbitmq.conf" in problem


def test_a_classic_queue_of_a_saga_queues_name_refuses_the_worker(rabbit: Rabbit) -> None:
    # Given the tool queue already declared classic (as a plain Celery app would have)
    with rabbit.connection() as connection:
        channel = connection.channel()
        channel.queue_declare(queue="celery", durable=True)
        try:
            # When a worker starts
            process = subprocess.run(
                [sys.executable, "-m", "celery", "-A", "tasks.app", "worker", "-c", "1"],
                env={**os.environ, **rabbit.env},
                cwd=ROOT,
                capture_output=True,
                text=True,
                timeout=60,
            )
        finally:
            channel.queue_delete(queue="celery")

    # Then it refuses, saying how to migrate
    assert process.returncode == 78, process.stderr[-2000:]
    assert REFUSAL in process.stderr
    assert "RabbitMQ queue 'celery' exists with other arguments" in process.stderr
    assert "delete_queue celery" in process.stderr
    assert "SAGA_RABBITMQ_QUEUE_TYPE=classic" in process.stderr


# -- runs on RabbitMQ --------------------------------------------------------------------------


def test_a_demo_run_completes_with_a_retry_through_native_delayed_delivery(
    world: Rabbit, worker: WorkerProcess
) -> None:
    # Given the credit fails once before its effect (so it is retried)
    rule = world.faults.fail("issue_credit")

    # When the agent runs the demo sequence
    run = world.saga.start_run()
    results = demo_steps(run)
    picture = run.finish(timeout=30)

    # Then it completes, the credit retried once and applied once
    assert len(results) == 4 and picture.state is RunState.COMPLETED
    assert world.faults.hits(rule) >= 1 and picture.step(2).attempts == 2
    assert [e["amount_cents"] for e in systems.ledger(ORDER)] == [CREDIT]
    # and the retry went through the broker's delay queues, not a worker-held ETA
    assert "not supported with native delayed delivery" not in worker.log()
    assert "direct exchange" not in worker.log()
    with world.connection() as connection:
        channel = connection.channel()
        for name in ("celery_delayed_0", "celery_delayed_27"):
            channel.queue_declare(queue=name, passive=True)
        for name in ("celery", "saga.turns"):
            _, _, consumers = channel.queue_declare(queue=name, passive=True)
            assert consumers == 1


def test_a_failing_run_compensates_on_rabbitmq(world: Rabbit) -> None:
    # Given the mail service is down
    systems.set_down("mail")

    # When the agent runs the sequence (the reply fails, the run unwinds)
    run = world.saga.start_run()
    assert len(demo_steps(run)) == 3
    picture = run.wait(timeout=30)

    # Then the credit is reversed and the ticket restored
    assert picture.state is RunState.COMPENSATED, picture.state
    kinds = [e["kind"] for e in systems.ledger(ORDER)]
    assert kinds == ["credit", "reversal"]


def test_doctor_shows_the_broker_kind_and_its_queues(world: Rabbit) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "saga.cli", "doctor", "--json"],
        env={**os.environ, **world.env},
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    checks = {c["name"]: c for c in json.loads(done.stdout)["checks"]}
    assert checks["broker"]["status"] == "ok"
    assert checks["broker"]["detail"].startswith("amqp at amqp://guest:***@")
    assert checks["queues"]["status"] == "ok", checks["queues"]
    assert "celery: 0 message(s), 1 consumer(s)" in checks["queues"]["detail"]
    assert "saga.turns: 0 message(s), 1 consumer(s)" in checks["queues"]["detail"]


def test_a_worker_killed_mid_step_is_redelivered_at_once_and_credits_once(
    world: Rabbit, worker: WorkerProcess
) -> None:
    # Given a credit step running (held in a 3 s delay) on the module's worker
    world.faults.delay("issue_credit", 3)
    run = world.saga.start_run()
    credit = run.call("issue_credit", order_id=ORDER, amount_cents=CREDIT, memo="late")
    wait_until(lambda: run.picture().step(1).state.value == "running", 15, "the credit to start")

    # When the whole worker is SIGKILLed and another starts (no visibility timeout to wait)
    worker.kill()
    standby = world.worker(concurrency=1, name="standby")
    try:
        # Then the broker hands the step to it at once, and the credit is applied once
        result = credit.result(timeout=30)
        picture = run.finish(timeout=15)
    finally:
        standby.kill()
    assert picture.state is RunState.COMPLETED and picture.step(1).attempts == 2
    credits = [e for e in systems.ledger(ORDER) if e["kind"] == "credit"]
    assert len(credits) == 1
    assert [e["args"] for e in picture.stack] == [{"credit_id": result["credit_id"]}]


def _consumers(rabbit: Rabbit) -> dict[str, int]:
    with rabbit.connection() as connection:
        channel = connection.channel()
        counts = {}
        for name in ("celery", TURN_QUEUE):
            _, _, consumers = channel.queue_declare(queue=name, passive=True)
            counts[name] = consumers
        return counts


def test_a_worker_named_no_queues_takes_the_tool_queue_alone_as_on_redis(
    rabbit: Rabbit, worker: WorkerProcess
) -> None:
    """``task_queues`` declares the turn queue too, and a worker without ``-Q`` would consume
    it with prefork slots (an app of tools only would fail every turn): it takes ``celery``
    alone, as it does on Redis, and says how to take turns."""
    before = _consumers(rabbit)
    process = WorkerProcess(
        "tasks.app", env=rabbit.env, concurrency=1, cwd=ROOT, logfile=rabbit.data / "no-q.log"
    )
    with process:
        wait_until(lambda: _consumers(rabbit)["celery"] == before["celery"] + 1, 30, "its consumer")
        assert _consumers(rabbit)[TURN_QUEUE] == before[TURN_QUEUE]
    assert f"not consuming {TURN_QUEUE} (no -Q given)" in process.log()


def test_the_turn_queue_is_left_out_only_when_no_queue_was_named() -> None:
    from saga.celery_amqp import amqp_settings, consume_turns_only_when_named

    def worker_queues(*named: str) -> Any:
        app = Celery("queues")
        app.conf.update(amqp_settings("amqp://guest@rabbit//"))
        queues = app.amqp.queues
        queues.select(list(named))  # what -Q does; nothing named: every declared queue
        return queues

    unnamed = worker_queues()
    assert consume_turns_only_when_named(unnamed)
    assert [q.name for q in unnamed.consume_from.values()] == ["celery"]
    both = worker_queues("celery", TURN_QUEUE)
    assert not consume_turns_only_when_named(both)
    assert sorted(both.consume_from) == ["celery", TURN_QUEUE]
    on_redis = Celery("redis", broker="redis://localhost:6379/0").amqp.queues
    assert not consume_turns_only_when_named(on_redis)
