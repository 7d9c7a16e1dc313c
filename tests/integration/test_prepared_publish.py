"""A step's message prepared once per task (``saga.prepared_publish``) is Celery's own, byte for
byte but for kombu's delivery tag, and Celery's publish sends it wherever something could tell
the difference.

The byte-for-byte tests publish each call twice on a Redis database of this module's own, with
no worker: once prepared, once through ``send_task`` (the prepared path turned off), and
compare the two list entries. A real worker running prepared messages is the session's worker
in every other integration test; ``test_a_worker_runs_prepared_steps`` counts them.
"""

from __future__ import annotations

import base64
import json
import re
import threading
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import Celery, Task
from celery._state import _task_stack
from celery.canvas import Signature, signature
from celery.signals import after_task_publish, before_task_publish

from saga import RunState, Saga, Settings, payload
from saga.constants import CONCLUDE_UNWIND_TASK, run_keys, tool_task_name
from saga.errors import DispatchError, StoreUnavailableError
from saga.model import StepState, ToolClass
from saga.prepared_publish import PreparedPublisher
from saga.stack import ReplicaConfirmation
from saga.unwind import send_chain
from tests.conftest import MACHINE_REDIS, TEST_DB, TEST_STORE, redis_url_with_db
from tests.integration.helpers import CREDIT, ORDER, demo_steps, moved_after_reading

pytestmark = pytest.mark.timeout(60)

#: A database of its own in the session's block (the listing's; its tests flush it too).
DB = TEST_DB - 3
QUEUE = "celery"


def _app(broker: str, **conf: Any) -> Celery:
    app = Celery("prepared")
    app.config_from_object("celeryconfig")
    app.conf.update(broker_url=broker, result_backend=broker, **conf)
    return app


@pytest.fixture
def url() -> Iterator[str]:
    if TEST_STORE != "redis":
        pytest.skip("the byte-for-byte tests need a plain Redis (the session's is not one)")
    url = redis_url_with_db(MACHINE_REDIS, DB)
    client = redis.Redis.from_url(url)
    client.flushdb()
    yield url
    client.flushdb()
    client.close()


@pytest.fixture
def private(url: str, tmp_path: Path) -> Iterator[Saga]:
    from tasks.tools import tools

    database = f"sqlite:///{tmp_path / 'saga.db'}"
    made = Saga(_app(url), tools, Settings(redis_url=url, database_url=database))
    yield made
    made.store.client.close()


def _both(
    saga: Saga, run_id: str, step: int, tool: str, args: Any, args_json: str = ""
) -> tuple[str, str]:
    """The list entry of the call prepared, then of the same call through ``send_task``."""
    client = redis.Redis.from_url(saga.settings.redis_url, decode_responses=True)
    core = saga.core
    args_json = args_json or json.dumps(args)
    core._send_step(run_id, step, tool, args, args_json)
    prepared = client.rpop(QUEUE)
    publish = core.prepared.publish
    core.prepared.publish = lambda *a, **k: False  # type: ignore[method-assign]
    try:
        core._send_step(run_id, step, tool, args, args_json)
    finally:
        core.prepared.publish = publish  # type: ignore[method-assign]
    celerys = client.rpop(QUEUE)
    assert client.llen(QUEUE) == 0
    client.close()
    assert prepared is not None and celerys is not None
    return prepared, celerys


def _without_tag(raw: str) -> tuple[str, dict[str, Any]]:
    message = json.loads(raw)
    tag = message["properties"]["delivery_tag"]
    del message["properties"]["delivery_tag"]
    return raw.replace(tag, "<tag>"), message


CALLS = {
    "plain": ("issue_credit", {"order_id": ORDER, "amount_cents": CREDIT}),
    "escapes": (
        "update_ticket",
        {"ticket_id": 7, "status": 'caf\u00e9 "q" \\ {x} \u2603 \n\t\U0001f600 %s {0}'},
    ),
    "long": ("update_ticket", {"ticket_id": 8, "status": "x" * 5000}),
    "mail": ("send_reply", {"to": "ada@example.com", "subject": "s", "body": "b"}),
}


@pytest.mark.parametrize("call", sorted(CALLS))
def test_a_prepared_message_is_celerys_byte_for_byte(private: Saga, call: str) -> None:
    tool, args = CALLS[call]
    # Given one call, published prepared and then through Celery's send_task
    prepared, celerys = _both(private, "run-\u00e9'x", 12, tool, args)
    # Then the two are the same bytes but for kombu's delivery tag (a fresh UUID each)
    (prepared_text, prepared_fields), (celery_text, celery_fields) = (
        _without_tag(prepared),
        _without_tag(celerys),
    )
    assert prepared_fields["headers"] == celery_fields["headers"]
    assert prepared_fields["properties"] == celery_fields["properties"]
    assert prepared_fields == celery_fields
    assert prepared_text == celery_text
    assert prepared_fields["headers"]["id"] == "run-\u00e9'x:12"


def test_a_prepared_message_names_its_own_thread(private: Saga) -> None:
    """The reply-to is the publishing thread's (Celery's ``thread_oid``), not the thread's
    that prepared the task's message."""
    client = redis.Redis.from_url(private.settings.redis_url, decode_responses=True)
    private.core._send_step("r", 1, "issue_credit", {"order_id": 1}, "{}")
    here = json.loads(client.rpop(QUEUE) or "{}")["properties"]["reply_to"]
    got: list[tuple[str, str]] = []
    thread = threading.Thread(
        target=lambda: got.append(_both(private, "r", 2, "issue_credit", {"order_id": 2}))
    )
    thread.start()
    thread.join(30)
    prepared, celerys = got[0]
    assert _without_tag(prepared) == _without_tag(celerys)
    assert json.loads(prepared)["properties"]["reply_to"] != here
    client.close()


def _prepares(saga: Saga) -> bool:
    return saga.core.prepared.publish("tools.issue_credit", "r:1", {"run_id": "r"}, "")


def test_celery_publishes_when_a_receiver_listens_to_its_publish(private: Saga) -> None:
    seen: list[str] = []

    def receiver(headers: dict[str, Any], **_: Any) -> None:
        seen.append(headers["id"])

    before_task_publish.connect(receiver)
    try:
        assert not _prepares(private)
        private.core._send_step("r", 3, "issue_credit", {"order_id": 1}, "{}")
    finally:
        before_task_publish.disconnect(receiver)
    assert seen == ["r:3"]
    assert _prepares(private)


def test_celery_publishes_from_inside_a_worker_task(private: Saga) -> None:
    """A task's publish carries its parent's ids (root and parent): Celery's to make."""
    parent = private.app.tasks["tools.issue_credit"]
    parent.push_request(id="parent", called_directly=False)
    _task_stack.push(parent)
    try:
        assert not _prepares(private)
        private.core._send_step("r", 4, "issue_credit", {"order_id": 1}, "{}")
    finally:
        _task_stack.pop()
        parent.pop_request()
    message = json.loads(redis.Redis.from_url(private.settings.redis_url).rpop(QUEUE) or "{}")
    assert message["headers"]["parent_id"] == "parent"


def test_celery_publishes_when_the_app_send_task_is_replaced(private: Saga) -> None:
    sent: list[str] = []
    private.app.send_task = lambda name, **kw: sent.append(kw["task_id"])  # type: ignore[method-assign]
    private.core._send_step("r", 5, "issue_credit", {"order_id": 1}, "{}")
    assert sent == ["r:5"]


@pytest.mark.parametrize(
    "change",
    ["sent event", "another database", "key prefix", "rabbitmq", "compression"],
)
def test_celery_publishes_what_a_prepared_message_cannot_be(
    url: str, tmp_path: Path, change: str
) -> None:
    conf: dict[str, Any] = {}
    broker = url
    if change == "sent event":
        conf["task_send_sent_event"] = True
    elif change == "another database":
        broker = redis_url_with_db(MACHINE_REDIS, DB + 1)
    elif change == "key prefix":
        conf["broker_transport_options"] = {"global_keyprefix": "p:"}
    elif change == "compression":
        conf["task_compression"] = "gzip"
    app = _app(broker, **conf)
    if change == "rabbitmq":
        app.conf.broker_url = "amqp://guest:guest@127.0.0.1:5672//"
    from saga.transport import use_pooled_client_transport

    use_pooled_client_transport(app)
    client = redis.Redis.from_url(url)
    publisher = PreparedPublisher(app, url, lambda: client, lambda task: {"declare": []})
    assert not publisher.publish("tools.issue_credit", "r:1", {"run_id": "r"}, "")
    assert client.llen(QUEUE) == 0
    client.close()


def test_a_broker_away_when_a_task_is_first_published_leaves_it_to_celery(url: str) -> None:
    """Nothing is kept of a message Celery could not make: the call goes through Celery's
    publish (which retries and raises as always), and a later call prepares it."""
    away = "redis://127.0.0.1:1/0"
    app = _app(away, broker_connection_retry=False, broker_connection_max_retries=0)
    from saga.transport import use_pooled_client_transport

    use_pooled_client_transport(app)
    client = redis.Redis.from_url(url)
    publisher = PreparedPublisher(app, away, lambda: client, lambda task: {"declare": []})
    assert not publisher.publish("tools.issue_credit", "r:1", {"run_id": "r"}, "")
    assert ("tools.issue_credit", "step") not in publisher._templates
    app.conf.broker_url = url
    publisher = PreparedPublisher(app, url, lambda: client, lambda task: {"declare": []})
    assert publisher.publish("tools.issue_credit", "r:1", {"run_id": "r"}, "")
    assert client.llen(QUEUE) == 1
    client.close()


def test_a_push_the_redis_refuses_fails_the_call_and_releases_its_step(private: Saga) -> None:
    """As when Celery's publish raises: the caller is told, the step is released, and the run
    goes on (a later call is taken)."""
    run = private.start_run()

    class Refusing:
        def lpush(self, *args: Any) -> int:
            raise redis.ConnectionError("the broker is away")

    prepared = private.core.prepared
    client = prepared._client
    prepared._client = lambda: Refusing()  # type: ignore[assignment, return-value]
    private.core._next_steps[run.run_id] = 7  # (a wrong guess: the message is pushed apart)
    try:
        with pytest.raises(DispatchError, match="the broker is away"):
            run.call("get_order", order_id=ORDER)
    finally:
        prepared._client = client
    picture = private.store.picture(run.run_id)
    assert picture is not None
    assert [s.state for s in picture.steps] == [StepState.NOT_DISPATCHED]
    queued = redis.Redis.from_url(private.settings.redis_url).llen(QUEUE)
    assert queued == 0
    run.call("get_order", order_id=ORDER)
    assert redis.Redis.from_url(private.settings.redis_url).llen(QUEUE) == 1


def _queued(saga: Saga) -> list[dict[str, Any]]:
    client = redis.Redis.from_url(saga.settings.redis_url, decode_responses=True)
    raw = client.lrange(QUEUE, 0, -1)
    client.delete(QUEUE)
    client.close()
    return [json.loads(m) for m in reversed(raw)]


def test_the_reservation_pushes_the_message_of_the_step_it_reserves(private: Saga) -> None:
    """One round trip: the step's message prepared for the run's next step is pushed by the
    reservation's script, the same message Celery would send."""
    core = private.core
    pushed: list[str] = []
    publish = core.prepared.publish
    core.prepared.publish = lambda *a: bool(pushed.append(a[1]))  # type: ignore[method-assign]
    run = private.start_run()
    run.call("get_order", order_id=ORDER)
    run.call("issue_credit", order_id=ORDER, amount_cents=CREDIT)
    core.prepared.publish = publish  # type: ignore[method-assign]
    assert pushed == []  # nothing pushed apart
    first, second = _queued(private)
    assert [first["headers"]["id"], second["headers"]["id"]] == [
        f"{run.run_id}:1",
        f"{run.run_id}:2",
    ]
    # The same bytes as Celery's own message for that step, but for the delivery tag
    wire = private.picture(run.run_id).step(2).args
    args_json = payload.dumps(wire, what="arguments", limit=1 << 20)
    _, celerys = _both(private, run.run_id, 2, "issue_credit", wire, args_json)
    assert _without_tag(json.dumps(second))[1] == _without_tag(celerys)[1]


def test_a_wrong_guess_of_the_next_step_pushes_nothing_with_the_reservation(
    private: Saga,
) -> None:
    """Another caller reserved a step of the run meanwhile: the script reserves a later step
    than the one the message was made for, pushes nothing, and the message of the step it
    did reserve is pushed apart, once."""
    run = private.start_run()
    run.call("get_order", order_id=ORDER)
    other = private.run(run.run_id)  # another handle: its dispatches move the same run on
    private.core._next_steps.pop(run.run_id)
    other.call("get_order", order_id=ORDER)  # guessed 1, given 2
    assert private.core._next_steps[run.run_id] == 3
    private.core._next_steps[run.run_id] = 2  # as a second process would still guess
    run.call("get_order", order_id=ORDER)  # guessed 2, given 3
    queued = _queued(private)
    assert [m["headers"]["id"] for m in queued] == [f"{run.run_id}:{n}" for n in (1, 2, 3)]


def test_replica_confirmation_pushes_the_message_after_the_reservation_is_confirmed(
    url: str, tmp_path: Path
) -> None:
    """With replicas to confirm, the message must not exist before the reservation is on
    one: the reservation pushes nothing (and here, with no replica, nothing is sent)."""
    from tasks.tools import tools

    database = f"sqlite:///{tmp_path / 'saga.db'}"
    made = Saga(_app(url), tools, Settings(redis_url=url, database_url=database))
    run = made.start_run()
    made.store.confirmation = ReplicaConfirmation(1, 50)  # (no replica: none will confirm)
    with pytest.raises(StoreUnavailableError, match="replica"):
        run.call("get_order", order_id=ORDER)
    assert _queued(made) == []
    made.store.client.close()


def test_a_worker_runs_prepared_steps(saga: Saga) -> None:
    """The session's worker runs the demo's steps from prepared messages, to the end."""
    real = saga
    if not real.core.prepared._same_redis:
        pytest.skip("this session's broker is not the store's Redis")
    counted: list[str] = []
    message = real.core.prepared.message

    def counting(task: str, *args: Any) -> tuple[str, str] | None:
        made = message(task, *args)
        if made is not None:
            counted.append(task)
        return made

    real.core.prepared.message = counting  # type: ignore[method-assign]
    try:
        run = real.start_run()
        demo_steps(run)
        run.finish(timeout=20)
    finally:
        real.core.prepared.message = message  # type: ignore[method-assign]
    assert counted == [
        "tools.get_order",
        "tools.issue_credit",
        "tools.set_ticket_status",
        "tools.send_reply",
    ]
    assert real.store.view(run.run_id).state == RunState.COMPLETED  # type: ignore[union-attr]


def _unwind(saga: Saga, run_id: str, steps: list[int]) -> list[Signature]:
    """An unwind's signatures as ``saga.unwind.unwind_chain`` makes them: each undo, most
    recent first, then the conclusion."""
    core = saga.core
    made = []
    for step in steps:
        task = tool_task_name("issue_credit")
        kwargs = {"run_id": run_id, "compensates": step, "unwind": "step:4"}
        made.append(
            saga.app.signature(
                task,
                kwargs=kwargs,
                immutable=True,
                task_id=f"{run_id}:{step}:undo:abcd1234",
                **core._publish_options(task),
            )
        )
    conclusion = {"run_id": run_id, "owner": "step:4", "sent_at": 1765000000.123456}
    made.append(
        saga.app.signature(
            CONCLUDE_UNWIND_TASK,
            kwargs=conclusion,
            immutable=True,
            **core._publish_options(CONCLUDE_UNWIND_TASK),
        )
    )
    return made


@contextmanager
def _in_a_worker_task(saga: Saga, request_id: str, root_id: str | None) -> Iterator[Task]:
    """As inside a worker's task: the task current, with its request's ids."""
    parent = saga.app.tasks["tools.set_ticket_status"]
    parent.push_request(id=request_id, root_id=root_id, called_directly=False, children=[])
    _task_stack.push(parent)
    try:
        yield parent
    finally:
        _task_stack.pop()
        parent.pop_request()


@pytest.mark.parametrize("undos", [1, 2])
@pytest.mark.parametrize("where", ["outside a task", "in a task", "in a root task"])
def test_an_unwinds_first_message_is_celerys_byte_for_byte(
    private: Saga, undos: int, where: str
) -> None:
    """The unwind's first message, carrying the rest of its chain, prepared as Celery's
    ``apply_async(chain=...)`` would send it: from a worker's task, with that task's ids as
    its parent and root, and added to its trail, as Celery's publish does."""
    run_id = "run-\u00e9'x\"{0}"
    signatures = _unwind(private, run_id, [3, 2][:undos])
    first, *rest = signatures
    client = redis.Redis.from_url(private.settings.redis_url, decode_responses=True)
    context: Any = nullcontext()
    if where != "outside a task":
        root = None if where == "in a root task" else "the-root"
        context = _in_a_worker_task(private, "the-parent", root)
    with context as parent:
        # Given the chain's first message prepared, then sent by Celery's own publish
        made = private.core.prepared.chain_message(first, rest[::-1])
        assert made is not None
        queue, prepared = made
        private.core.prepared.pushed_from_here(first)
        send_chain(signatures)
        celerys = client.rpop(QUEUE)
        assert client.llen(QUEUE) == 0 and celerys is not None
        trail = [r.id for r in parent.request.children] if parent is not None else []
    client.close()
    # Then they are the same bytes but for kombu's delivery tag, to the same queue
    assert queue == QUEUE
    (prepared_text, prepared_fields), (celery_text, celery_fields) = (
        _without_tag(prepared),
        _without_tag(celerys),
    )
    assert prepared_fields["headers"] == celery_fields["headers"]
    assert prepared_fields == celery_fields
    assert prepared_text == celery_text
    headers = prepared_fields["headers"]
    if where == "outside a task":
        assert (headers["parent_id"], headers["root_id"]) == (None, first.options["task_id"])
    else:
        root = "the-parent" if where == "in a root task" else "the-root"
        assert (headers["parent_id"], headers["root_id"]) == ("the-parent", root)
        assert trail == [first.options["task_id"]] * 2  # once each way
    body = json.loads(base64.b64decode(prepared_fields["body"]))
    assert [s["task"] for s in body[2]["chain"]][::-1] == [s.task for s in rest]


@pytest.mark.parametrize("root", [None, "the-root"])
def test_the_rest_of_an_unwind_is_celerys_byte_for_byte(private: Saga, root: str | None) -> None:
    """The rest of an unwind, passed on from an undo's task as Celery's tracer passes a
    chain on (the chain as the task's message carried it, plain dicts), prepared."""
    signatures = _unwind(private, "run-r", [3, 2])
    # The chain as the first undo's message carries it: decoded from JSON
    remaining = json.loads(json.dumps([dict(s) for s in signatures[1:][::-1]]))
    client = redis.Redis.from_url(private.settings.redis_url, decode_responses=True)
    with _in_a_worker_task(private, "the-undo", root) as undo:
        following = signature(remaining[-1], app=private.app)
        made = private.core.prepared.chain_message(following, remaining[:-1])
        assert made is not None
        # As celery.app.trace sends the chain's next on success
        signature(remaining[-1], app=private.app).apply_async(
            (None,), chain=remaining[:-1], parent_id=undo.request.id, root_id=root
        )
        celerys = client.rpop(QUEUE)
    client.close()
    assert celerys is not None
    assert _without_tag(made[1]) == _without_tag(celerys)
    headers = json.loads(made[1])["headers"]
    assert (headers["id"], headers["parent_id"]) == ("run-r:2:undo:abcd1234", "the-undo")
    assert headers["root_id"] == (root or "the-undo")


def test_an_unwinds_message_is_celerys_to_send_where_it_cannot_be_prepared(
    private: Saga,
) -> None:
    """Celery's publish sends it where the parent's priority is inherited, the first
    signature is not the shape ``unwind_chain`` makes, or a receiver listens."""
    first, *rest = _unwind(private, "r", [2])
    prepared = private.core.prepared
    private.app.conf.task_inherit_parent_priority = True
    with _in_a_worker_task(private, "p", None):
        assert prepared.chain_message(first, rest) is None
    private.app.conf.task_inherit_parent_priority = False
    assert prepared.chain_message(rest[0], []) is None  # (no task id of its own)
    with_args = first.clone()
    with_args["args"] = (1,)
    assert prepared.chain_message(with_args, rest) is None

    def receiver(**_: Any) -> None:
        pass

    after_task_publish.connect(receiver)
    try:
        assert prepared.chain_message(first, rest) is None
    finally:
        after_task_publish.disconnect(receiver)
    assert prepared.chain_message(first, rest) is not None


def test_the_unwind_is_pushed_with_its_mark_only_by_its_owner(private: Saga) -> None:
    """``Core.start_unwind`` pushes the chain prepared in the mark's script: one message,
    marked sent; an owner the reaper replaced meanwhile sends nothing."""
    from tests.integration.test_stack import fail, start, succeed

    store, core = private.store, private.core
    run = private.start_run()
    credit = start(store, run.run_id, "issue_credit", ToolClass.COMPENSATABLE_WRITE)
    succeed(store, run.run_id, credit, "reverse_credit")
    mail = start(store, run.run_id, "send_reply", ToolClass.COMPENSATABLE_WRITE)
    assert fail(store, run.run_id, mail).owns_unwind
    owner = f"step:{mail}"
    picture = store.picture(run.run_id)
    assert picture is not None
    # The store away when the mark is made: nothing sent, nothing marked, False (the reaper
    # sends the unwind at the run's deadline)
    mark_sent = store.mark_sent

    def away(*args: Any) -> bool:
        raise StoreUnavailableError("the store is away")

    store.mark_sent = away  # type: ignore[method-assign]
    try:
        assert core.start_unwind(run.run_id, owner, picture) is False
    finally:
        store.mark_sent = mark_sent  # type: ignore[method-assign]
    assert _queued(private) == []
    assert store.client.hget(run_keys(run.run_id)[0], "sent") == "0"
    # The reaper took the unwind over meanwhile: this owner sends nothing
    store.client.hset(run_keys(run.run_id)[0], "owner", "reaper:1")
    assert core.start_unwind(run.run_id, owner, picture) is True
    assert _queued(private) == []
    # Its owner's is pushed with the mark: one message, the undo's, carrying the conclusion
    store.client.hset(run_keys(run.run_id)[0], "owner", owner)
    assert core.start_unwind(run.run_id, owner, picture) is True
    (message,) = _queued(private)
    run_hash = store.client.hgetall(run_keys(run.run_id)[0])
    assert (run_hash["sent"], run_hash["sent_chain"]) == ("1", message["headers"]["id"])
    assert message["headers"]["task"] == "tools.reverse_credit"
    body = json.loads(base64.b64decode(message["body"]))
    assert body[1] == {"run_id": run.run_id, "compensates": credit, "unwind": owner}
    assert [s["task"] for s in body[2]["chain"]] == [CONCLUDE_UNWIND_TASK]


def test_the_final_failure_pushes_its_unwind_with_its_record(
    private: Saga, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A step's final failure, where the unwind's message is prepared, is recorded, its chain
    pushed and marked sent by one script, with no mark of its own; a run that moved on
    between the reading the chain was made from and the record is unwound the usual way,
    once."""
    from saga.forward import _record_failure
    from tests.integration.test_stack import start, succeed

    store, core = private.store, private.core
    error = {"type": "RuntimeError", "message": "mail is down"}
    marks: list[tuple[Any, ...]] = []
    mark_sent = store.mark_sent

    def counted(*args: Any) -> bool:
        marks.append(args)
        return mark_sent(*args)

    def failing_run() -> tuple[str, int, int]:
        run = private.start_run()
        credit = start(store, run.run_id, "issue_credit", ToolClass.COMPENSATABLE_WRITE)
        succeed(store, run.run_id, credit, "reverse_credit")
        mail = start(store, run.run_id, "send_reply", ToolClass.REVERSIBLE_WRITE)
        return run.run_id, credit, mail

    def unwound(run_id: str, credit: int, mail: int) -> None:
        (message,) = _queued(private)
        run_hash = store.client.hgetall(run_keys(run_id)[0])
        assert (run_hash["owner"], run_hash["sent"]) == (f"step:{mail}", "1")
        assert run_hash["sent_chain"] == message["headers"]["id"]
        assert message["headers"]["task"] == "tools.reverse_credit"
        body = json.loads(base64.b64decode(message["body"]))
        assert body[1] == {"run_id": run_id, "compensates": credit, "unwind": f"step:{mail}"}
        assert [s["task"] for s in body[2]["chain"]] == [CONCLUDE_UNWIND_TASK]

    monkeypatch.setattr(store, "mark_sent", counted)
    run_id, credit, mail = failing_run()
    _record_failure(core, run_id, mail, error, "fail")
    unwound(run_id, credit, mail)
    assert marks == []

    # Another writer moves the run on just after it was read: the record pushes nothing,
    # and the owner it made sends the chain with a mark of its own
    run_id, credit, mail = failing_run()
    moved = moved_after_reading(store, monkeypatch)
    _record_failure(core, run_id, mail, error, "fail")
    assert moved == [run_id]
    unwound(run_id, credit, mail)
    assert [m[:2] for m in marks] == [(run_id, f"step:{mail}")]


def test_a_worker_pushes_an_unwind_with_its_scripts(saga: Saga) -> None:
    """On the session's worker, a failing run's unwind is pushed by the scripts: its first
    message by the failure's record, the next undo's by the script recording the newer one
    done; Celery publishes none of them. The last undo's record concludes the run."""
    from benchmarks.commands import Monitor
    from tasks import systems

    if not saga.core.prepared._same_redis:
        pytest.skip("this session's broker is not the store's Redis")
    systems.set_down("mail")
    monitor = Monitor(saga.settings.redis_url)
    try:
        run = saga.start_run()
        demo_steps(run)
        assert run.wait(timeout=30).state is RunState.COMPENSATED
    finally:
        lines = monitor.stop()
    undos = [line for line in lines if f"{run.run_id}:" in line and ":undo:" in line]
    pushes = [line for line in undos if '"LPUSH"' in line]
    assert len(pushes) == 2, pushes
    assert all(re.search(r"\[\d+ lua\] ", line) for line in pushes), pushes
    # The first by the script that recorded the mail step's failure, no mark after it
    script = _script_around(lines, lines.index(pushes[0]))
    assert any('"failed"' in line and '"HSET"' in line for line in script), script
    marks = [line for line in lines if '"sent_chain"' in line and run.run_id in line]
    assert len(marks) == 1, marks
    # The run concluded by the script that recorded its last undo done
    (ended,) = [
        i
        for i, line in enumerate(lines)
        if '"HSET"' in line and '"state" "compensated"' in line and run.run_id in line
    ]
    script = _script_around(lines, ended)
    assert any('"done"' in line and ":state" in line for line in script), script


def _script_around(lines: list[str], at: int) -> list[str]:
    """The lines of the script call whose command ``lines[at]`` is (MONITOR's ``lua`` lines
    after its ``EVALSHA``), up to that line."""
    start = at
    while start > 0 and " lua] " in lines[start]:
        start -= 1
    return lines[start : at + 1]


@pytest.mark.parametrize(
    ("broker", "store", "same"),
    [
        ("redis://h:6379/0", "redis://h:6379/0?client_name=caller", True),
        ("redis://h:6379", "redis://h:6379/0", True),
        ("redis://h:6379/2", "redis://h:6379?db=2", True),
        ("redis://h:6379/2", "redis://h:6379/3", False),
        ("redis://h:6379/0", "redis://h:6380/0", False),
        ("redis://:a@h:6379/0", "redis://:b@h:6379/0", False),
        ("redis://h:6379/0", "rediss://h:6379/0", False),
    ],
)
def test_the_broker_is_the_store_when_they_name_one_server_and_database(
    broker: str, store: str, same: bool
) -> None:
    from saga.prepared_publish import _broker_is_store
    from saga.transport import use_pooled_client_transport

    app = _app(broker)
    use_pooled_client_transport(app)
    assert _broker_is_store(app, store) is same
