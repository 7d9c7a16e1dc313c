"""The unwind as Celery sends it: the compensations still to run, most recent first, as one
chain ending in ``saga.conclude_unwind``.

It needs only the Celery app, the tools of this deploy and the run's store, never the whole
``Saga``: whoever owns the unwind (a failed step's worker, an abort, the reaper, a requeue)
builds the same chain from the same picture.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from celery import Celery
from celery.canvas import Signature

from saga import metrics, rules
from saga.constants import CONCLUDE_UNWIND_TASK, tool_task_name
from saga.errors import UnknownToolError
from saga.model import CompensationState
from saga.picture import RunPicture
from saga.prepared_publish import PreparedPublisher
from saga.stack import ChainPush, RunStore
from saga.tools import ToolRegistry

logger = logging.getLogger("saga")


def unwind_chain(
    app: Celery,
    registry: ToolRegistry,
    store: RunStore,
    picture: RunPicture,
    owner: str,
    publish_options: Callable[[str], dict[str, Any]],
) -> list[Signature]:
    """The chain's signatures, the conclusion last. An undo that cannot be sent (broken when
    pushed, or its tool gone from this deploy) is recorded as a failed compensation here, so
    the conclusion escalates naming it instead of the chain failing on an unknown task."""
    run_id = picture.run_id
    # An undo waiting for a person's answer keeps its place: its message finds the question
    # and stops the chain there (``saga.compensation``), so the older undos never run before
    # the answer, whoever sends the unwind (a reaper that read the run just before the undo
    # asked takes the unwind over, and must not send the older undos past the question).
    to_run = {
        c.step
        for c in picture.compensations
        if c.state
        in (CompensationState.PENDING, CompensationState.RUNNING, CompensationState.ASKED)
    }
    signatures = []
    # Unique per unwind: a revoked id would be discarded forever on requeue.
    unwind = uuid.uuid4().hex[:8]
    for entry in rules.unwind_order(picture.stack):
        step = int(entry["step"])
        if step not in to_run:
            continue
        problem = _unrunnable(registry, entry)
        if problem:
            error = {"type": "CompensationBuildError", "message": problem}
            store.record_compensation(run_id, step, "fail", error)
            continue
        task = tool_task_name(entry["tool"])
        signatures.append(
            app.signature(
                task,
                kwargs={"run_id": run_id, "compensates": step, "unwind": owner},
                immutable=True,
                task_id=f"{run_id}:{step}:undo:{unwind}",
                **publish_options(task),
            )
        )
    # ``sent_at`` (Redis clock) times the unwind, for the metrics.
    conclusion = {"run_id": run_id, "owner": owner, "sent_at": store.now()}
    signatures.append(
        app.signature(
            CONCLUDE_UNWIND_TASK,
            kwargs=conclusion,
            immutable=True,
            **publish_options(CONCLUDE_UNWIND_TASK),
        )
    )
    return signatures


def send_chain(signatures: list[Signature]) -> None:
    """What ``celery.chain(*signatures).apply_async()`` sends (the first task, carrying the
    rest, next last), without the canvas's cloning and freezing of each member."""
    first, *rest = signatures
    first.apply_async(chain=rest[::-1])


def send_unwind(
    store: RunStore,
    publisher: PreparedPublisher,
    picture: RunPicture,
    owner: str,
    signatures: list[Signature],
) -> bool:
    """Send ``owner``'s chain and mark it sent (``Core.start_unwind``): by Celery's publish,
    then the mark; or, where its message is prepared, by the mark's script, sent and marked as
    one or neither. False when the broker refused it (logged: the run stays unwinding, owned
    and not sent, so the reaper takes it over at its deadline and sends it again)."""
    run_id = picture.run_id
    push = prepared_chain(publisher, signatures)
    mine = True
    try:
        if push is None:
            send_chain(signatures)
        else:
            mine = store.mark_sent(run_id, owner, push)
    except Exception as exc:
        logger.error(
            "run %s: the broker did not take its unwind (%r); the reaper will", run_id, exc
        )
        return False
    if push is None:
        store.mark_sent(run_id, owner)
    elif not mine:  # another owns the unwind now (the reaper took it over): its chain
        logger.info("run %s: its unwind is no longer %s's; nothing sent", run_id, owner)
        return True
    else:
        publisher.pushed_from_here(signatures[0])
    unwinding(picture, signatures)
    return True


def unwinding(picture: RunPicture, signatures: list[Signature]) -> None:
    """A chain is on the broker: its stack's depth measured and its start logged."""
    metrics.stack_depth(len(picture.stack))
    logger.info("run %s: unwinding %d compensation(s)", picture.run_id, len(signatures) - 1)


@dataclass(frozen=True)
class PreparedUnwind:
    """An unwind's chain made before the script that makes its owner runs, and its first
    message prepared for that script to push (``prepared_unwind``)."""

    signatures: list[Signature]
    push: ChainPush


def prepared_unwind(
    app: Celery,
    registry: ToolRegistry,
    store: RunStore,
    publisher: PreparedPublisher,
    publish_options: Callable[[str], dict[str, Any]],
    picture: RunPicture,
    owner: str,
) -> PreparedUnwind | None:
    """The chain ``Core.start_unwind`` would send from ``picture`` (the run as the script
    will leave it), prepared for the script that makes ``owner`` the owner to push with the
    mark (``RunStore.record_failure_and_push``). None where the usual way must send it:
    Celery's publish sends it, or making it writes (an undo that cannot be sent is recorded
    failed, which only the owner may do)."""
    if not publisher.may_prepare() or any(_unrunnable(registry, e) for e in picture.stack):
        return None
    signatures = unwind_chain(app, registry, store, picture, owner, publish_options)
    push = prepared_chain(publisher, signatures)
    return None if push is None else PreparedUnwind(signatures, push)


def prepared_chain(publisher: PreparedPublisher, signatures: list[Signature]) -> ChainPush | None:
    """The message ``send_chain`` would send, prepared (``saga.prepared_publish``) for
    ``RunStore.mark_sent`` to push with the mark; None where Celery's publish must send it."""
    first, *rest = signatures
    made = publisher.chain_message(first, rest[::-1])
    if made is None:
        return None
    return ChainPush(made[0], str(first.options["task_id"]), made[1])


def _unrunnable(registry: ToolRegistry, entry: dict[str, Any]) -> str:
    """Why an undo on the stack cannot be sent; '' when it can."""
    if entry.get("broken"):
        return str(entry["description"])
    try:
        registry.get(entry["tool"])
    except UnknownToolError:
        return f"compensation tool {entry['tool']!r} is not registered in this deploy"
    return ""
