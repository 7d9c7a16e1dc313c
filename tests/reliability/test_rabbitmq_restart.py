"""The broker restarted under a run: a RabbitMQ node of the test's own (``rabbit_node``), the
store on a private Redis. A step running while the node restarts cannot be acknowledged on its
dead channel, so its message comes back (quorum queues keep it on the node's disk) and the
delivery replays the recorded outcome: the credit is applied once, and the run goes on and
completes on the restarted node. A dropped connection does the same."""

from __future__ import annotations

import shutil
from collections.abc import Callable, Iterator

import pytest
from celery import Celery

from saga import RunState, Saga
from saga.celery_amqp import amqp_settings
from tests.integration.helpers import CREDIT, ORDER, TICKET, wait_until
from tests.reliability.conftest import TIME_LIMIT, Private
from tests.reliability.rabbit_node import RabbitNode
from tests.reliability.test_crashes import credits_and_reversals, processed

pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RabbitNode]:
    if shutil.which("rabbitmq-server") is None:
        from tests.conftest import service_missing

        service_missing("rabbitmq-server is missing (Debian: apt-get install rabbitmq-server)")
    with RabbitNode(tmp_path_factory.mktemp("rabbit")) as started:
        yield started


@pytest.fixture
def on_rabbit(private: Callable[..., Private], node: RabbitNode) -> Iterator[tuple[Private, Saga]]:
    """A private store whose workers and caller use the test's RabbitMQ node as the broker."""
    env = private(extra_env={"SAGA_BROKER_URL": node.url})
    app = Celery("rabbit-restart")
    app.config_from_object("celeryconfig")
    app.conf.update(
        broker_url=node.url,
        result_backend=env.url + "/0",
        task_time_limit=TIME_LIMIT,
        task_soft_time_limit=TIME_LIMIT - 1,
        **amqp_settings(node.url),
    )
    saga = Saga(app, env.saga.registry, env.saga.settings)
    try:
        yield env, saga
    finally:
        for worker in env.workers:
            worker.kill()
        saga.store.client.close()


@pytest.mark.parametrize("fault", ["restart", "drop"])
def test_a_step_running_while_the_broker_goes_away_credits_once_and_the_run_completes(
    on_rabbit: tuple[Private, Saga], node: RabbitNode, fault: str
) -> None:
    # Given a worker on the node, and a credit that takes a few seconds
    env, saga = on_rabbit
    worker = env.worker(concurrency=1)
    env.faults.delay("issue_credit", 3.0, point="after_effect")  # under the 4 s soft limit
    run = saga.start_run()
    handle = run.call("issue_credit", order_id=ORDER, amount_cents=CREDIT, memo="restart")
    wait_until(lambda: credits_and_reversals(run.run_id) == (1, 0), what="the credit")

    # When the node restarts (or drops every connection) while the step still runs
    if fault == "restart":
        node.restart()
    else:
        assert node.drop_connections() >= 1

    # Then the step's outcome is the credit, applied once (the message that came back is
    # replayed), and the run goes on through the node: another call, then the end
    assert handle.result(timeout=60)["amount_cents"] == CREDIT
    status = run.call("set_ticket_status", ticket_id=TICKET, status="pending").result(timeout=60)
    assert status is not None
    assert run.finish(timeout=60).state is RunState.COMPLETED
    wait_until(lambda: processed(worker, f"{run.run_id}:1"), 60, "the credit's task to finish")
    assert credits_and_reversals(run.run_id) == (1, 0)
    assert worker.alive()
