"""The agent loop, hosted on the workers: one Celery task per turn.

A turn (``saga.agent_turn``, on the ``saga.turns`` queue, served by a threads pool so a model
call never holds a prefork slot) asks the policy once, records the answer (first writer
wins), then dispatches the answer's calls (``saga.agents.turn_calls``) through
``Core.dispatch`` in the model's order, each under its marker ``<turn>:<call>``, which the
reserve script records with the step. It never waits for a step: whoever settles the turn's
last step (a tool task, through ``Core.step_settled`` and ``saga.agents.loop_listener``; or
the turn itself, if every call was refused or settled at once) marks the turn done, first
writer wins, and sends the next turn.

Crash-safety: a redelivered turn finds its answer recorded and does not ask again; each call
is either refused (recorded), or already has its step (the dispatcher answers it, and sends
its message again only if no delivery began it, which the tool task replays), or is
dispatched now. A lost "next turn" is sent again by the step's redelivery or, past the
run's deadline, by the reaper (``run_idle``).
"""

from __future__ import annotations

import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import redis
from billiard.exceptions import SoftTimeLimitExceeded  # type: ignore[import-untyped]

from saga import telemetry
from saga.agents.agent import Agent, AgentRegistry, OnLimit
from saga.agents.launch import publish_agents, send_turn
from saga.agents.lease import ASKER_FENCE, FENCE_POLL, TURN_LEASE_SECONDS, Hold, keeper_for
from saga.agents.messages import ModelTurn
from saga.agents.policies import take_turn
from saga.agents.transcript import Transcript
from saga.agents.turn_calls import Placed, dispatch_calls
from saga.agents.turn_state import (
    LoopState,
    TurnStore,
    consecutive_refusals,
    transcript_until,
    turn_results,
)
from saga.celery_amqp import broker_countdown
from saga.constants import AGENT_TURN_TASK, START_UNWIND_TASK
from saga.core import Core
from saga.errors import (
    ModelCallError,
    PayloadError,
    RunContendedError,
    RunEndedError,
    StepsInFlightError,
    StoreUnavailableError,
    UnknownAgentError,
)
from saga.model import RunState
from saga.picture import RunPicture
from saga.redis_errors import unavailable
from saga.soft_limit import call_time, kept_for_the_call

logger = logging.getLogger("saga.agents")

#: Longest wait a provider's Retry-After is honoured for, so a retried turn stays well within
#: the broker's visibility timeout.
LONGEST_MODEL_WAIT = 300.0
#: A turn whose model is being asked by another delivery comes back after this long.
_LEASE_WAIT = 2.0
#: How many times a delivery fencing the last asker asks again before it gives the turn
#: back (the store kept going away under the fence): three fences' worth.
_FENCE_POLLS = int(3 * ASKER_FENCE.seconds / FENCE_POLL)
#: How often a turn whose run kept changing under its dispatch is played again at once.
_CONTENDED_REPLAYS = 10


@dataclass(frozen=True)
class Again:
    """Play the turn again after ``delay`` seconds."""

    delay: float
    #: A model call failed and is asked again: it spends one of the agent's model attempts.
    #: Waiting for another delivery's answer, or for Redis, spends none.
    model_attempt: bool = False


@dataclass
class Delivery:
    """What one delivery of a turn keeps across its replays (``play_turn``): the token its
    asks of the model are made under, so an ask repeated after a lost reply or an unconfirmed
    write is counted once; and the model's answer once it has one, so a replay after the
    store lost the recorded answer (a failover) records it again instead of asking again."""

    token: str = field(default_factory=lambda: uuid.uuid4().hex)
    answer: ModelTurn | None = None


def run_turn(
    core: Core,
    agents: AgentRegistry,
    run_id: str,
    turn: int,
    attempt: int = 1,
    delivery: Delivery | None = None,
) -> Again | None:
    """Play turn ``turn`` of a hosted run (``attempt``: of its model call); returns when to
    try again (a retryable model error, or another delivery asking the model), else None."""
    delivery = delivery or Delivery()
    picture = core.store.picture(run_id)
    state = LoopState.parse(picture.agent) if picture is not None else None
    if picture is None or state is None:
        logger.error("run %s: turn %d of a run with no agent state; dropped", run_id, turn)
        return None
    end = (state.end or end_of(state.ended)) if state.ended else ""
    if (picture.state is RunState.RUNNING and end) or (
        picture.state is RunState.UNWINDING and end and end != OnLimit.FINISH
    ):
        # The loop's end was recorded and not carried out (its delivery died in between, or
        # the reply of its abort was lost, so nobody sent the unwind): carry it out, as
        # recorded (an abort with the same reason sends the unwind if nobody has). A final
        # answer completes; it never unwinds.
        carry_out_end(core, run_id, end, state.ended)
        return None
    if picture.state is not RunState.RUNNING or turn in state.advanced:
        return None  # the run is failing or ended, or this turn is done: a late duplicate
    if turn != state.current_turn:
        logger.warning(
            "run %s: turn %d arrived while turn %d is current", run_id, turn, state.current_turn
        )
        return None
    try:
        agent = agents.get(state.agent)
    except UnknownAgentError as exc:
        _not_hosted(core, run_id, turn, str(exc))
        return None
    if state.deadline_open:  # enqueued before any worker said what this agent's deadline is
        core.store.adopt_deadline(run_id, agent.deadline or core.settings.run_deadline_seconds)
    turns = turn_store(core)
    answer = state.answers.get(turn)
    if answer is not None:
        # Recorded by another delivery, maybe on a master no replica has confirmed it from
        # yet: acted on, then lost with a failover, the run would go on from an answer it
        # has no record of. Unconfirmed in time: the turn plays again from a fresh read.
        core.store.confirm("the turn's recorded answer", run_id)
    if answer is None:
        asked = _ask(core, turns, agent, picture, state, turn, attempt, delivery)
        if not isinstance(asked, ModelTurn):
            return asked
        answer = asked
    _strike(core, "after_model_answer", agent.name)
    if answer.finished:
        _end(core, run_id, turn, OnLimit.FINISH, "final answer")
        return None
    used = sum(1 for s in picture.steps if s.call and int(s.call.split(":")[0]) < turn)
    if used + len(answer.calls) > agent.limits.max_tool_calls:
        why = f"tool call limit: {used} made, {len(answer.calls)} more asked for, limit "
        _end(core, run_id, turn, agent.limits.on_limit, f"{why}{agent.limits.max_tool_calls}")
        return None
    placed = dispatch_calls(core, turns, agent, picture, state, turn, answer)
    if placed is Placed.BY_OTHERS:
        advance_if_settled(core, run_id, turn)
    return None


def play_turn(
    core: Core, agents: AgentRegistry, run_id: str, turn: int, attempt: int = 1
) -> Again | None:
    """``run_turn``, played again (a replay: every write of a turn is first-writer-wins)
    while the stack's Redis is away, for ``store_outage_patience`` at most, and while the run
    keeps changing under a dispatch. Waiting here, not in a Celery retry: when Redis is away
    the broker often is too, and a retry that cannot be published would lose the turn."""
    patience = time.monotonic() + core.settings.store_outage_patience
    pause, contended = 0.1, 0
    delivery = Delivery()
    while True:
        try:
            # Each replay reads the run afresh (after a failover, from the new master).
            return run_turn(core, agents, run_id, turn, attempt, delivery)
        except RunContendedError:
            contended += 1
            if contended > _CONTENDED_REPLAYS:
                raise
        except (StoreUnavailableError, redis.RedisError) as exc:
            away = isinstance(exc, StoreUnavailableError) or unavailable(exc)
            if not away or time.monotonic() >= patience:
                raise  # the task fails; the reaper sends the turn again at the deadline
            logger.warning("run %s turn %d: %s; playing it again", run_id, turn, exc)
            time.sleep(pause)
            pause = min(pause * 2, 2.0)


def turn_store(core: Core) -> TurnStore:
    """A hosted run's loop records, under this deployment's size limits."""
    settings = core.settings
    return TurnStore(core.store, settings.max_payload_bytes, settings.max_transcript_bytes)


def _ask(
    core: Core,
    turns: TurnStore,
    agent: Agent,
    picture: RunPicture,
    state: LoopState,
    turn: int,
    attempt: int,
    delivery: Delivery,
) -> ModelTurn | Again | None:
    """Freeze the results the model is about to read, check the limits, and ask the policy
    once: the recorded answer, when to try again, or None when the run ended here."""
    run_id = picture.run_id
    try:
        _freeze_earlier_results(turns, picture, state, turn)
    except PayloadError as exc:  # the same on every delivery: end as the agent's limits say
        _end(core, run_id, turn, agent.limits.on_limit, f"transcript limit: {exc}")
        return None
    ended = _limit_reached(agent, state, turn, core.settings.max_transcript_bytes)
    if ended is not None:
        how, why = ended
        _end(core, run_id, turn, how, why)
        return None
    # Every delivery died or failed asking: stop looping. Judged under the lease (by the
    # script), never while another delivery's model call may still answer.
    most = agent.model_retry.attempts + core.settings.max_redeliveries
    hold = Hold(run_id, turn, min(core.lease_seconds, TURN_LEASE_SECONDS), delivery.token)
    # A replay's ask under the same token is counted once (ask_model.lua).
    taken = turns.ask_model(run_id, turn, hold.seconds, hold.token, most, ASKER_FENCE)
    polls = 0
    while taken == "fenced" and polls < _FENCE_POLLS:  # the last asker may be alive: watch
        time.sleep(FENCE_POLL)
        polls += 1
        taken = turns.ask_model(run_id, turn, hold.seconds, hold.token, most, ASKER_FENCE)
    if taken == "ended":  # aborted or reaped since this delivery read the run
        logger.info("run %s turn %d: the run ended before the model was asked", run_id, turn)
        return None
    if taken in ("busy", "fenced"):
        return Again(_LEASE_WAIT)
    if taken == "answered":  # recorded since this delivery read the run: play it again
        return Again(0.0)
    if taken == "spent":
        why = f"turn {turn} was asked {most} times without an answer"
        _end(core, run_id, turn, OnLimit.UNWIND, why)
        return None
    recorded: ModelTurn | None = None  # recording the answer releases the lease
    keep_lease = False
    try:
        if delivery.answer is None:
            with keeper_for(core.store).holding(hold):
                answer = _model_answer(core, agent, run_id, turn, transcript_until(state, turn))
            # Kept in hand: should recording it fail (Redis away, or no replica holding it in
            # time, and then a failover), the replay records this answer, never asks again.
            delivery.answer = answer.with_usable_call_ids(turn)
            # Answered, not recorded: a delivery that dies here leaves the turn unanswered, and
            # its redelivery asks the model again (which may answer differently: the drill's
            # ``model_differs_on_replay``). Nothing of this answer may act before it is recorded.
            _strike(core, "after_model_call", agent.name)
        recorded = turns.record_answer(run_id, turn, delivery.answer, hold.token)
        return recorded
    except ModelCallError as exc:
        if exc.retryable and agent.model_retry.allows_another(attempt):
            wait = exc.retry_after if exc.retry_after is not None else None
            delay = agent.model_retry.delay(attempt) if wait is None else wait
            logger.warning("run %s turn %d: %s; asking again in %.1fs", run_id, turn, exc, delay)
            return Again(min(delay, LONGEST_MODEL_WAIT), model_attempt=True)
        _end(core, run_id, turn, OnLimit.UNWIND, f"model call failed: {exc}")
    except PayloadError as exc:
        _end(core, run_id, turn, OnLimit.UNWIND, f"the model's answer cannot be kept: {exc}")
    except RunEndedError as exc:  # aborted, or reaped as hung, while the model thought
        logger.info("run %s turn %d: the answer came after the run ended (%s)", run_id, turn, exc)
    except StoreUnavailableError:
        # Redis away, not the policy's fault: the delivery plays the turn again, keeping
        # the lease while it holds an answer to record (nobody else may ask meanwhile).
        keep_lease = delivery.answer is not None
        raise
    except Exception as exc:  # a bug in the policy: every retry would fail the same way
        logger.exception("run %s turn %d: the policy raised", run_id, turn)
        _end(core, run_id, turn, OnLimit.UNWIND, f"the policy failed: {type(exc).__name__}: {exc}")
    finally:
        if recorded is None and not keep_lease:
            turns.release_lease(run_id, turn, hold.token)
    return None


def _model_answer(
    core: Core, agent: Agent, run_id: str, turn: int, transcript: Transcript
) -> ModelTurn:
    """The model asked once, in the call's own time: in a prefork pool, Celery's soft time
    limit cuts this call short, never the recording around it (``saga.soft_limit``). A call
    it cut short is a model that did not answer in time, not a bug in the policy: asked
    again as ``model_retry`` allows, by a delivery with a time limit of its own."""
    try:
        with call_time():
            _strike(core, "during_model_call", agent.name)
            return telemetry.model_call(
                run_id, turn, agent, take_turn, agent.policy, transcript, agent.tools
            )
    except SoftTimeLimitExceeded as exc:
        raise ModelCallError(
            "the model did not answer within the task's soft time limit", retryable=True
        ) from exc


def _freeze_earlier_results(
    turns: TurnStore, picture: RunPicture, state: LoopState, turn: int
) -> None:
    """Record what each earlier turn's calls returned, as the model is about to read it
    (first writer wins: every delivery, and the transcript, shows the same)."""
    for k in range(1, turn):
        if state.answers[k].calls and k not in state.results:
            results = turn_results(picture, state, k)
            if results is None:  # cannot happen: turn k advanced only once all settled
                logger.error("run %s: turn %d started before %d settled", picture.run_id, turn, k)
                continue
            state.results[k] = turns.freeze_results(picture.run_id, k, results)


def _limit_reached(
    agent: Agent, state: LoopState, turn: int, transcript_limit: int
) -> tuple[OnLimit | str, str] | None:
    """Checked before each model call: the turn before has settled, so finishing is possible."""
    limits = agent.limits
    refusals = consecutive_refusals(state, turn)
    if refusals > limits.max_consecutive_refusals:
        return OnLimit.UNWIND, f"{refusals} refused or failed calls in a row"
    if turn > limits.max_turns:
        return limits.on_limit, f"turn limit: {limits.max_turns} turns"
    if limits.token_budget is not None and state.usage.total_tokens >= limits.token_budget:
        used = state.usage.total_tokens
        return limits.on_limit, f"token budget: {used} of {limits.token_budget} used"
    if state.size > transcript_limit:
        return limits.on_limit, f"transcript limit: {state.size} of {transcript_limit} bytes"
    return None


def advance_if_settled(core: Core, run_id: str, turn: int) -> None:
    """If every call of ``turn`` is refused or settled, mark the turn done (first writer wins)
    and send the next one. Safe to call any number of times, from anywhere."""
    if core.store.advance_turn(run_id, turn=turn):
        send_turn(core.app, run_id, turn + 1)


def _end(core: Core, run_id: str, turn: int, how: OnLimit | str, why: str) -> None:
    """Stop the loop: record why and how (first writer wins), then carry it out."""
    what = f"run {run_id} turn {turn}: the loop's end"
    why, end = core.patiently(
        what, turn_store(core).mark_ended, run_id, turn, why, OnLimit(how).value
    )
    logger.info("run %s: the loop ends at turn %d (%s): %s", run_id, turn, end, why)
    _strike(core, "after_loop_ended", "")
    # Carried out here, not by playing the turn again (which would ask the model again when
    # a failover lost the end's record).
    core.patiently(what, carry_out_end, core, run_id, end, why)


#: The end of a loop whose agent this worker does not host (see ``carry_out_end``).
_NOT_HOSTED = "not_hosted"


def _not_hosted(core: Core, run_id: str, turn: int, why: str) -> None:
    logger.error("run %s: %s", run_id, why)
    why, end = turn_store(core).mark_ended(run_id, turn, f"failed to start: {why}", _NOT_HOSTED)
    carry_out_end(core, run_id, end, why)


def carry_out_end(core: Core, run_id: str, end: str, why: str) -> None:
    """Complete the run (``finish``) or abort it (``unwind``: unwind, or escalate past the
    pivot), as the loop's recorded end says. Whoever finds the end recorded and the run still
    running calls this again: the turn's redelivery, or the reaper.

    An agent this worker does not host (``not_hosted``): a run that never dispatched a step
    ends ``failed_to_start`` (nothing to undo: it is no compensation); one that did (a deploy
    removed its agent mid-run) cannot go on, and unwinds."""
    try:
        if end == _NOT_HOSTED and core.fail_to_start(run_id, why):
            return
        if end == OnLimit.FINISH:
            try:
                core.complete(run_id)
            except StepsInFlightError as exc:
                # Never unwind a finished loop: complete once they settle (the reaper does).
                logger.warning("run %s: finished, waiting for %s to settle", run_id, exc)
            return
        core.abort(run_id, why)
    except RunEndedError:
        pass


def end_of(ended: str) -> str:
    """The end of a loop recorded before ends said what to do: only a final answer finished."""
    return OnLimit.FINISH.value if ended == "final answer" else OnLimit.UNWIND.value


def _strike(core: Core, point: str, name: str) -> None:
    if core.faults is not None:
        core.faults.strike(point, name)


def turn_task_options(core: Core) -> dict[str, Any]:
    """The Celery options of the tasks on the turns queue."""
    return {
        "bind": True,
        "acks_late": True,
        "reject_on_worker_lost": True,
        "max_retries": None,  # the agent's model_retry decides
        "ignore_result": True,
        "shared": False,
        # Task events (Flower) only if asked for: see Settings.turn_events.
        "send_events": core.settings.turn_events,
    }


def publish_hosted_agents(core: Core, agents: AgentRegistry) -> None:
    """Say which agents this app hosts (``saga.client`` refuses the others): a worker as it
    starts, a ``Saga`` as it first enqueues a run."""
    try:
        publish_agents(core.store, agents)
    except StoreUnavailableError:
        logger.exception("could not publish the agents this worker hosts")


def install_turn_tasks(app: Any, core: Core, agents: AgentRegistry) -> None:
    """Register ``saga.agent_turn`` and ``saga.start_unwind`` (both on the turns queue)."""
    options = turn_task_options(core)

    @app.task(name=AGENT_TURN_TASK, **options)
    @telemetry.traced_turn
    def agent_turn(self: Any, run_id: str, turn: int, attempt: int = 1) -> None:
        # In a prefork pool the soft time limit is the model call's alone (``_model_answer``).
        with kept_for_the_call(f"run {run_id} turn {turn}[{self.request.id}]"):
            again = play_turn(core, agents, run_id, int(turn), attempt=int(attempt))
            if again is not None:
                attempt = attempt + 1 if again.model_attempt else attempt
                kwargs = {"run_id": run_id, "turn": turn, "attempt": attempt}
                # (on quorum queues a countdown under a second would be dropped, not waited)
                countdown = broker_countdown(self.app.conf, again.delay)
                raise self.retry(countdown=countdown, kwargs=kwargs)

    @app.task(name=START_UNWIND_TASK, **options)
    def start_unwind(self: Any, run_id: str, owner: str) -> None:
        picture = core.store.picture(run_id)
        if picture is None or picture.state is not RunState.UNWINDING:
            return
        if picture.extra.get("owner") == owner and picture.extra.get("sent") == "0":
            core.start_unwind(run_id, owner)
