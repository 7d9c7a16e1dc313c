"""The drill with a hosted agent as the scenario: its run enqueued on the workers, its model
played by a ``FakeModel`` script, the drill acting as the person for its approvals.

A ``HostedScenario`` names the agent, its input and the model's script (one answer per turn,
as ``FakeModel`` takes them). The model is served where the worker's SDK client talks (the
plugin's ``saga_model``; ``saga drill --agent`` serves one and points its worker at it), and
the drill plays the script for each case. One clean run discovers the steps and the turns; then
the step kinds of a driven drill strike the hosted run's steps, the drill watching the run
where a driven scenario would have made the next call: it aborts once a step settled (the
next turn's model call held meanwhile, so the run cannot end first), once a held effect is
under way, and delivers a step's message again once the step exists. And each model turn
meets ``model_differs_on_replay`` (``saga.testing.drill_turns``).

The person approves what it is shown, through the operation the API and the console use
(``Client.approve``), bound to the hash of the call as shown; a request whose hash is not
that call's is denied, and named a mismatch.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from saga.agents.lease import ASKER_FENCE
from saga.agents.turn_state import LoopState
from saga.constants import tool_task_name
from saga.errors import SagaError
from saga.model import RunState, StepState
from saga.testing.drill import Drill, DrillReport, Progress, install_rule
from saga.testing.drill_judge import CaseResult
from saga.testing.drill_plan import (
    HOLD_SECONDS,
    TURN_KINDS,
    Fault,
    PlannedStep,
    plan,
)
from saga.testing.drill_turns import (
    Approvals,
    judge_approvals,
    judge_replay,
    plan_turns,
    shown_hash,
)

if TYPE_CHECKING:
    from saga.client import Client
    from saga.engine import Saga
    from saga.picture import RunPicture, StepRecord
    from saga.runs import Run
    from saga.testing.fake_models import FakeModel, Step
    from saga.testing.processes import WorkerProcess

#: Who the drill's approvals are by, in the run's record.
PERSON = "saga drill"
#: Seconds a redelivered turn spends within one delivery before it may ask again, once the
#: dead asker's lease ran out: the asker fence, and a margin for its polls. A prefork pool's
#: soft time limit must allow it (a threads pool has none), or the turn is lost there.
FENCE_NEEDS = ASKER_FENCE.seconds + 2.0
#: The task time limit ``saga drill --agent`` gives its worker: a soft limit of 7 s.
HOSTED_TIME_LIMIT = 8
_POLL = 0.05
#: A step no longer under way: its outcome is recorded.
_UNDER_WAY = (StepState.DISPATCHED, StepState.RUNNING)


@dataclass(frozen=True)
class HostedScenario:
    """A hosted run as the drill's scenario: ``agent`` given ``input``, its model answering
    turn by turn as ``script`` says (``FakeModel`` steps); ``variants[turn]``, the model's
    answer when that turn is asked again (``model_differs_on_replay``; where none is given,
    the drill makes one where it safely can); ``setup``, called before each play."""

    agent: str
    input: str
    script: Sequence[Step]
    variants: Mapping[int, Step] = field(default_factory=dict)
    setup: Callable[[], Any] | None = None
    name: str = ""

    @property
    def title(self) -> str:
        return self.name or f"agent {self.agent}"


def _not_driven(run: Run) -> None:
    raise TypeError("a hosted scenario is played by its agent, not called with a Run")


class HostedDrill(Drill):
    """Plays ``scenario``'s agent on ``saga``'s real workers, its model ``model`` (served where
    the workers' SDK clients talk), once clean, then once per fault."""

    def __init__(
        self,
        saga: Saga,
        scenario: HostedScenario,
        model: FakeModel,
        *,
        timeout: float = 60.0,
        progress: Progress | None = None,
        worker: WorkerProcess | None = None,
    ) -> None:
        saga.agents.get(scenario.agent)  # an agent the app does not host: UnknownAgentError
        super().__init__(
            saga,
            _not_driven,
            timeout=timeout,
            progress=progress,
            worker=worker,
            name=scenario.title,
        )
        self.hosted = scenario
        self.model = model
        #: The variant of each turn planned (``model_differs_on_replay``).
        self.variants: dict[int, Step] = {}
        #: The turn whose answer dispatched each step of the clean run, by position.
        self._turn_of: dict[int, int] = {}
        #: The clean run's position of the nth step of each tool: ``(tool, n)``.
        self._positions: dict[tuple[str, int], int] = {}
        self._client: Client | None = None

    def run(
        self,
        *,
        max_cases: int | None = None,
        seed: int = 0,
        kinds: Iterable[str] | None = None,
    ) -> DrillReport:
        try:
            return super().run(max_cases=max_cases, seed=seed, kinds=kinds)
        finally:
            if self._client is not None:
                self._client.store.client.close()
                self._client = None

    # -- the plan ---------------------------------------------------------------------------

    def _steps(self, run_id: str) -> list[PlannedStep]:
        """The clean run's steps that were dispatched (a call refused before it was, such as
        an irreversible one while writes were unsettled, never meets a fault)."""
        picture = self.saga.picture(run_id)
        undos = {int(e["step"]): str(e["tool"]) for e in picture.stack if "step" in e}
        ran = [s for s in _ordered(picture) if s.state is not StepState.NOT_DISPATCHED]
        self._turn_of = {p: int(s.call.split(":")[0]) for p, s in enumerate(ran, 1) if s.call}
        self._positions = _positions_by_call(ran)
        return [
            PlannedStep(position, s.tool, s.tool_class, undos.get(s.step, ""))
            for position, s in enumerate(ran, 1)
        ]

    def _plan(self, steps: list[PlannedStep], clean: CaseResult) -> tuple[list[Fault], list[str]]:
        picture = self.saga.picture(clean.run_id)
        self._renumbered(clean, picture)  # its steps as planned: refused calls take no position
        state = LoopState.parse(picture.agent)
        turns = sorted(state.answers) if state is not None else []
        short = self._too_short()
        if short:
            return plan(steps, self.saga), [f"model_differs_on_replay not planned: {short}"]
        faults, self.variants, notes = plan_turns(
            self.hosted.agent, turns, self.hosted.script, self.hosted.variants, self.saga
        )
        return plan(steps, self.saga) + faults, notes

    def _too_short(self) -> str:
        """Why a turn asked again cannot be played on this worker ('' if it can): its pool's
        soft time limit ends the delivery before the asker fence lets it ask."""
        if self.worker is not None and self.worker.pool == "threads":
            return ""
        soft = float(self.saga.app.conf.get("task_soft_time_limit") or 0)
        if not soft or soft >= FENCE_NEEDS:
            return ""
        return (
            f"a turn asked again waits for the asker fence within one delivery (about "
            f"{FENCE_NEEDS:g} s), past the worker's soft time limit ({soft:g} s); give the "
            f"worker a task time limit of {HOSTED_TIME_LIMIT} s or more (SAGA_TASK_TIME_LIMIT, "
            "--saga-task-time-limit)"
        )

    # -- one case -----------------------------------------------------------------------------

    def play(self, fault: Fault) -> CaseResult:
        """One case: the world set up, the fault installed, the model's script played, the run
        enqueued and watched (approved, aborted, a message delivered again) to its end."""
        started = time.monotonic()
        if self.worker is not None and not self.worker.alive():
            self.worker.restart()
        self.faults.clear()
        result = CaseResult(fault)
        person = Approvals()
        try:
            if self.hosted.setup is not None:
                self.hosted.setup()
            replays = {fault.turn - 1: self.variants[fault.turn]} if fault.turn else {}
            self.model.play(self.hosted.script, replays=replays)
            rule = self._install(fault)
            result.run_id = self.saga.enqueue_run(self.hosted.agent, self.hosted.input)
            picture = self._watch(result, rule, person)
            result.hits = None if rule is None else self.faults.hits(rule)
        finally:
            self.faults.clear()
        if fault.kind == "none" and not self.model.answered:
            result.mismatch(
                "the drill's model was never asked: the agent's SDK client must talk to it "
                "(FakeModel.environ(url) in the worker's environment)"
            )
        if fault.kind in TURN_KINDS and picture.state.ended:
            judge_replay(self.saga, picture, self.model.asks(fault.turn - 1), result)
        judge_approvals(self.saga, picture, self.hosted.agent, person, result)
        return self._renumbered(self.conclude(result, picture, started), picture)

    def _renumbered(self, result: CaseResult, picture: RunPicture) -> CaseResult:
        """The case's steps at the clean run's positions (the nth step of a tool where the
        clean run had its nth), so that the matrix's columns hold: another answer may make the
        same calls in another order, and a call refused before dispatch takes no position."""
        if not self._positions:
            return result
        ordered = _ordered(picture)
        ran = [s for s in ordered if s.state is not StepState.NOT_DISPATCHED]
        at = {s.step: i for i, s in enumerate(ordered, 1)}  # as the judgment numbered them
        moved = {at[s.step]: self._positions.get(key, at[s.step]) for key, s in _keyed(ran)}
        result.steps = [replace(o, step=moved.get(o.step, o.step)) for o in result.steps]
        result.mismatches = [
            replace(m, step=moved.get(m.step, m.step)) if m.step else m for m in result.mismatches
        ]
        return result

    def _install(self, fault: Fault) -> str | None:
        """The fault's rule (None: none, or an abort), and, for an abort after a step, the
        next turn's model call held, so that the run cannot end before the drill aborts it."""
        if fault.kind == "none":
            return None
        if fault.kind in TURN_KINDS:
            return self.faults.kill("after_model_call", self.hosted.agent, nth=fault.turn)
        if fault.abort_after and fault.kind != "aborted_mid_effect":
            turn = self._turn_of.get(fault.abort_after, 0)
            self.faults.delay(
                self.hosted.agent, HOLD_SECONDS, nth=turn + 1, point="during_model_call"
            )
        return install_rule(self.faults, fault)

    def _watch(self, result: CaseResult, rule: str | None, person: Approvals) -> RunPicture:
        """Until the run ends: strike where the fault says (once), and answer its approvals."""
        fault, run = result.fault, self.saga.run(result.run_id)
        deadline = time.monotonic() + self.timeout
        struck = not (fault.abort_after or fault.kind == "delivered_twice")
        picture = run.picture()
        while not picture.state.ended and time.monotonic() < deadline:
            if picture.state is RunState.RUNNING:
                acted = False
                if not struck:
                    struck = acted = self._strike(fault, rule, picture, run, result)
                if not acted:  # (the picture is older than what the drill just did)
                    self._answer(picture, person, result)
            time.sleep(_POLL)
            picture = run.picture()
        # The run's messages settled (a turn held or redelivered, a copy), before the judgment
        # and the next case: a turn of this run must not ask the next case's model.
        if not self._quiet() and result.copy:
            result.mismatch(f"the broker still held messages {self.timeout:.0f} s after the run")
        return run.picture()

    def _strike(
        self, fault: Fault, rule: str | None, picture: RunPicture, run: Run, result: CaseResult
    ) -> bool:
        """Whether the moment came and the drill struck: a copy of the step's message once the
        step exists; an abort while its held effect is under way; an abort once the step
        settled (and, for ``undo_delivered_twice``, a copy of its undo's message)."""
        steps = [s for s in _ordered(picture) if s.state is not StepState.NOT_DISPATCHED]
        if fault.kind == "delivered_twice":
            if len(steps) < fault.step:
                return False
            self._copy(steps[fault.step - 1], result)
            return True
        if fault.kind == "aborted_mid_effect":
            if rule is None or self.faults.hits(rule) < fault.nth:
                return False
            self._abort(run, f"drill: aborted during step {fault.step}")
            return True
        if len(steps) < fault.abort_after:
            return False
        after = steps[fault.abort_after - 1]
        if after.state in _UNDER_WAY or after.step in picture.in_flight:
            return False
        self._abort(run, f"drill: aborted after step {fault.abort_after}")
        if fault.kind == "undo_delivered_twice" and len(steps) >= fault.step:
            self._strike_undo(run, steps[fault.step - 1].step, result)
        return True

    def _copy(self, step: StepRecord, result: CaseResult) -> None:
        """``delivered_twice``: the step's message again, as its turn dispatched it."""
        tool = self.saga.registry.get(step.tool)
        result.copy = f"{result.run_id}:{step.step}"
        self.saga.app.send_task(
            tool_task_name(step.tool),
            kwargs={"run_id": result.run_id, "step": step.step, "args": tool.validate(step.args)},
            task_id=result.copy,
            ignore_result=True,
        )

    @staticmethod
    def _abort(run: Run, reason: str) -> None:
        with contextlib.suppress(SagaError):  # it ended meanwhile: judged as it ended
            run.abort(reason)

    def _answer(self, picture: RunPicture, person: Approvals, result: CaseResult) -> None:
        """As the person: approve each call the run asks about, bound to the hash of the call
        as shown; deny (and name) a request bound to anything else."""
        state = LoopState.parse(picture.agent)
        if state is None:
            return
        for request in state.pending_approvals():
            marker = str(request["id"])
            if marker in person.answered:
                continue
            person.answered.add(marker)
            shown, asked = shown_hash(request), str(request.get("args_hash"))
            client = self.client()
            try:
                if shown == asked:
                    client.approve(picture.run_id, marker, args_hash=shown, by=PERSON)
                    person.given.add((marker, shown))
                    continue
                why = "the request's hash is not that of the call it shows"
                client.deny(picture.run_id, marker, why, args_hash=asked, by=PERSON)
                result.mismatch(f"approval {marker} of {request.get('tool')}: {why}", step=0)
            except SagaError as exc:
                if self.saga.picture(picture.run_id).state is RunState.RUNNING:
                    result.mismatch(f"approval {marker} could not be given: {exc}", step=0)
                # else: the run stopped meanwhile (a failed step unwinds it): nothing to approve

    def client(self) -> Client:
        """The caller's client the person decides through (``saga.client``, as the API)."""
        if self._client is None:
            # Imported on use: only a hosted drill with approvals needs it.
            from saga.client import Client

            self._client = Client(settings=self.saga.settings)
        return self._client


def _ordered(picture: RunPicture) -> list[StepRecord]:
    return sorted(picture.steps, key=lambda s: s.step)


def _keyed(steps: list[StepRecord]) -> list[tuple[tuple[str, int], StepRecord]]:
    """Each step keyed by its tool and which of that tool's steps it is (from 1)."""
    seen: dict[str, int] = {}
    keyed = []
    for s in steps:
        seen[s.tool] = seen.get(s.tool, 0) + 1
        keyed.append(((s.tool, seen[s.tool]), s))
    return keyed


def _positions_by_call(steps: list[StepRecord]) -> dict[tuple[str, int], int]:
    """The position (from 1) of the nth step of each tool among ``steps``."""
    return {key: position for position, (key, _) in enumerate(_keyed(steps), 1)}
