"""Starting a hosted run and sending its turns: what the web app (``saga.client``) and the
workers share. No tool code, no Celery import: tasks are sent by name on the app given.

The workers publish the agents they host (``publish_agents``, as each starts), so a web app
that knows nothing but the URLs can still refuse a run of an agent no worker runs, and start
every run on its agent's own deadline. A run enqueued before any worker published has the
web app's default deadline until its first turn: the turn worker, which hosts the agent, then
gives it the agent's own (``adopt_deadline.lua``), before an approval or the reaper is judged
by it.
"""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from saga import metrics
from saga.agents.agent import Agent
from saga.constants import AGENT_TURN_TASK, AGENTS_KEY, TURN_QUEUE, agent_key, turn_task_id
from saga.errors import MessageNotSentError, PayloadError, RunExistsError, UnknownAgentError
from saga.stack import RunHead, RunStore, reachable
from saga.validation import check_agent_name, check_deadline, check_run_id, check_text

logger = logging.getLogger("saga.agents")


@dataclass(frozen=True)
class Launched:
    """What a start did: the run's id, and whether this call created it (the create script
    decides: of two calls with one id at the same moment, exactly one created it)."""

    run_id: str
    created: bool


def enqueue_run(
    store: RunStore,
    app: Any,
    agent: str,
    input: str,
    run_id: str | None = None,
    deadline: float = 900,
    max_input_bytes: int = 256 * 1024,
    deadline_open: bool = False,
) -> str:
    """``launch_run``, for callers that need the id only."""
    return launch_run(
        store, app, agent, input, run_id, deadline, max_input_bytes, deadline_open
    ).run_id


def launch_run(
    store: RunStore,
    app: Any,
    agent: str,
    input: str,
    run_id: str | None = None,
    deadline: float = 900,
    max_input_bytes: int = 256 * 1024,
    deadline_open: bool = False,
) -> Launched:
    """Create the run and its loop's state in one script, then send turn 1.

    The same ``run_id`` again is not an error: the run exists, so nothing is created, and
    turn 1 is sent again only if it has no answer yet (the first call may have died before
    sending it, or the broker refused it; a second message of a turn only replays it). So a
    caller told ``MessageNotSentError`` converges on the one run by calling again with the
    error's ``run_id``."""
    run_id, deadline = checked_run(agent, input, run_id, deadline, max_input_bytes)
    created = store.create(
        run_id, deadline, agent=agent, input_json=input, deadline_open=deadline_open
    )
    if created:
        metrics.run_started()
    else:
        with reachable("enqueue_run"):
            existing = store.client.hget(agent_key(run_id), "name")
            started = store.client.hexists(agent_key(run_id), "1:answer")
        if not first_turn_due(run_id, agent, existing, started, store.head(run_id)):
            return Launched(run_id, created)
    try:
        send_turn(app, run_id, 1)
    except Exception as exc:
        raise first_turn_not_sent(run_id, exc) from exc
    return Launched(run_id, created)


def checked_run(
    agent: str, input: Any, run_id: str | None, deadline: float, max_input_bytes: int
) -> tuple[str, float]:
    """The run's id (a new one if None) and deadline, once its agent and input are valid:
    what the sync and the asyncio client check the same way before anything is written."""
    check_agent_name(agent)
    if not isinstance(input, str):
        raise PayloadError("the input of a hosted run is the user's message, a string")
    check_text("input", input, max_length=max_input_bytes)
    if len(input.encode()) > max_input_bytes:
        raise PayloadError(f"the input is over the limit of {max_input_bytes} bytes")
    run_id = uuid.uuid4().hex if run_id is None else check_run_id(run_id)
    return run_id, check_deadline(deadline)


def first_turn_due(
    run_id: str, agent: str, existing: object, started: bool, head: RunHead | None
) -> bool:
    """The run existed already (``existing``: the agent its loop names): whether turn 1 is
    to be sent again (the first call may have died before sending it; a second message of a
    turn only replays it). ``RunExistsError`` for a run of another agent, or of ``run.call``."""
    if existing != agent:
        owner = f"agent {existing!r}" if existing else "run.call"
        raise RunExistsError(f"run {run_id} already exists, driven by {owner}")
    return not started and head is not None and head.state.value == "running"


def first_turn_not_sent(run_id: str, exc: Exception) -> MessageNotSentError:
    """The error a web app gets when the run is created but its first turn was not sent: it
    names the run, what stands and what is pending, never the broker's address (the log has
    the cause)."""
    logger.error("run %s: the broker did not take turn 1 (%r)", run_id, exc)
    return MessageNotSentError(
        run_id, "created", "turn 1", "starting it again with the same run id"
    )


def send_turn(app: Any, run_id: str, turn: int, task: str = AGENT_TURN_TASK) -> None:
    """Send turn ``turn`` to the turns queue, under the turn's own task id (``task``: another
    task to send as a turn is sent, as the benchmark does to price a message on its own).

    The arguments' repr (what Flower shows) is written here: Celery's generic ``saferepr``
    of two plain values is about a sixth of a send, paid by a tool worker for each turn."""
    app.send_task(
        task,
        kwargs={"run_id": run_id, "turn": turn},
        task_id=turn_task_id(run_id, turn),
        queue=TURN_QUEUE,
        argsrepr="()",
        kwargsrepr=f"{{'run_id': {run_id!r}, 'turn': {turn!r}}}",
    )


def publish_agents(store: RunStore, agents: Iterable[Agent]) -> None:
    """Say which agents this worker hosts, and on which deadline (None: the app's default).
    Entries are added or updated, never removed: a worker of another deploy may still run an
    agent this one no longer declares."""
    entries = {
        agent.name: json.dumps(
            {
                "deadline": agent.deadline,
                "tools": list(agent.tool_names),
                "approval": sorted(agent.approval),
            }
        )
        for agent in agents
    }
    if entries:
        with reachable("publish_agents"), store.client.pipeline(transaction=True) as pipe:
            for name, entry in entries.items():
                pipe.hset(AGENTS_KEY, name, entry)
            pipe.execute()


def published_agent(store: RunStore, name: str) -> dict[str, Any] | None:
    """What the workers published of agent ``name``; ``UnknownAgentError`` when workers have
    published agents and none of them is ``name``; None when none has published any (the
    client cannot know, and the turn worker decides)."""
    with reachable("published_agent"):
        entry = store.client.hget(AGENTS_KEY, name)
        known = [] if entry is not None else store.client.hkeys(AGENTS_KEY)
    return published_entry(name, entry, known)


def published_entry(
    name: str, entry: str | bytes | None, known: Iterable[object]
) -> dict[str, Any] | None:
    """``published_agent`` from what Redis answered: agent ``name``'s entry, else the names of
    the agents the workers host (``known``, read only when there is no entry)."""
    if entry is not None:
        found: dict[str, Any] = json.loads(entry)
        return found
    hosts = sorted(str(other) for other in known)
    if hosts:
        hosted = ", ".join(hosts)
        raise UnknownAgentError(f"no worker hosts an agent {name!r}; the workers host: {hosted}")
    return None
