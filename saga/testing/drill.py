"""``saga drill``: replay one scenario once per fault and judge each run by the world.

A scenario is a Python function that takes a ``Run`` and makes its calls, as an agent loop
would (``run.call(...).result(...)``); or a run from the records, replayed
(``saga.testing.drill_replay``). One clean run discovers its steps; then each case installs one
fault (``saga.testing.Faults``, acted on by a real worker) and plays the scenario again: each
step failing before its effect, after it (every attempt: the lookup's path), killed mid-effect
(redelivery), delivered twice (a copy of its message while its effect is under way); each undo
failing once before its effect, once after it, always, killed mid-effect and delivered twice;
the run aborted after each step and while each step's effect is under way
(``saga.testing.drill_plan``).

Each case is judged by what the tools' systems say, not by saga's own word
(``saga.testing.drill_judge``); ``saga.testing.drill_report`` renders the result. A hosted
agent, its model played by a fake model's script, is a scenario too
(``saga.testing.drill_hosted``), whose model turns meet ``model_differs_on_replay``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from saga.constants import TURN_QUEUE, tool_task_name
from saga.errors import SagaError
from saga.model import CompensationState, RunState
from saga.runs import Run
from saga.testing.drill_judge import CaseResult, Mismatch, StepOutcome, judge
from saga.testing.drill_plan import (
    DUPLICATE_KINDS,
    HOLD_SECONDS,
    KINDS,
    MEANINGS,
    Fault,
    PlannedStep,
    pivot_of,
    plan,
    sample,
)
from saga.testing.faults import Faults

if TYPE_CHECKING:
    from saga.engine import Saga
    from saga.picture import RunPicture
    from saga.runs import StepHandle
    from saga.testing.processes import WorkerProcess

__all__ = [
    "KINDS",
    "MEANINGS",
    "CaseResult",
    "Drill",
    "DrillError",
    "DrillReport",
    "Fault",
    "Mismatch",
    "PlannedStep",
    "Progress",
    "Scenario",
    "StepOutcome",
    "install_rule",
    "judge",
    "plan",
    "sample",
]

#: A scripted, driven run: it makes its calls on the run it is given (and may finish it).
Scenario = Callable[["Run"], Any]
#: Told one line per case as the drill goes.
Progress = Callable[[str], None]
#: How often the drill looks at a run or a rule's hits while it waits for a moment to strike.
_POLL = 0.05


class DrillError(SagaError):
    """The drill could not run: the scenario made no steps, or its clean run failed."""


@dataclass
class DrillReport:
    scenario: str
    #: The clean run's steps: (position, tool, class).
    steps: list[tuple[int, str, int]]
    cases: list[CaseResult]
    #: Cases planned but left out by ``max_cases``.
    skipped: int = 0
    seed: int = 0
    #: What the drill could not plan, and why (a model turn with no safe variant, ...).
    notes: list[str] = field(default_factory=list)

    @property
    def mismatches(self) -> list[Mismatch]:
        return [m for case in self.cases for m in case.mismatches]

    @property
    def ok(self) -> bool:
        return not self.mismatches

    @property
    def pivot(self) -> int:
        """The position of the scenario's pivot (its first irreversible step; 0: none)."""
        return next((p for p, _, c in self.steps if c == 5), 0)


class _Stopped(BaseException):
    """Ends the scenario where an abort case aborts it (not an ``Exception``: a scenario's own
    ``except Exception`` must not swallow it)."""


#: Told each call the scenario made: its position, its handle and the arguments it was given.
_OnCall = Callable[[int, "StepHandle", dict[str, Any]], None]


class _DrillRun(Run):
    """The ``Run`` the scenario gets: the real one, aborted once ``abort_after`` calls were
    made (before the next call, or when the scenario finishes); ``on_call`` is told of each."""

    def __init__(self, run: Run, abort_after: int, on_call: _OnCall | None = None) -> None:
        super().__init__(run.core, run.run_id)
        self.on_failure = run.on_failure
        self._abort_after = abort_after
        self._on_call = on_call
        self.calls = 0
        #: The run's step of each call, in the order they were made.
        self.steps: list[int] = []

    def call(self, tool: str, /, **args: Any) -> StepHandle:
        self._maybe_stop()
        self.calls += 1
        handle = super().call(tool, **args)
        self.steps.append(handle.step)
        if self._on_call is not None:
            self._on_call(self.calls, handle, args)
        return handle

    def finish(self, timeout: float | None = None) -> RunPicture:
        self._maybe_stop()
        return super().finish(timeout)

    def _maybe_stop(self) -> None:
        if self._abort_after and self.calls >= self._abort_after:
            raise _Stopped


class Drill:
    """Plays ``scenario`` on ``saga``'s real workers once clean, then once per fault."""

    def __init__(
        self,
        saga: Saga,
        scenario: Scenario,
        *,
        timeout: float = 60.0,
        progress: Progress | None = None,
        worker: WorkerProcess | None = None,
        name: str = "",
    ) -> None:
        self.saga = saga
        #: Started again before a case if a fault took it down.
        self.worker = worker
        self.scenario = scenario
        self.name = name or getattr(scenario, "__qualname__", repr(scenario))
        self.timeout = timeout
        self.progress = progress or (lambda line: None)
        self.faults = Faults(saga.store.client, known_tools=[t.name for t in saga.registry])

    def run(
        self,
        *,
        max_cases: int | None = None,
        seed: int = 0,
        kinds: Iterable[str] | None = None,
    ) -> DrillReport:
        """The clean run, then the cases (``max_cases`` of them sampled with ``seed``;
        only the ``kinds`` named)."""
        wanted = set(kinds or KINDS)
        unknown = wanted - set(KINDS)
        if unknown:
            raise ValueError(f"unknown fault kind(s) {sorted(unknown)}; known: {', '.join(KINDS)}")
        self.progress("drill: the clean run")
        clean = self.play(Fault("none"))
        if clean.end_state != RunState.COMPLETED.value or clean.mismatches:
            why = clean.raised or clean.reason or "; ".join(map(str, clean.mismatches))
            raise DrillError(f"the clean run of {self.name} ended {clean.end_state}: {why}")
        planned = self._steps(clean.run_id)
        every, notes = self._plan(planned, clean)
        if not every:
            raise DrillError(f"{self.name} made no calls")
        cases = [f for f in every if f.kind in wanted]
        chosen = sample(cases, max_cases, seed)
        report = DrillReport(
            scenario=self.name,
            steps=[(p.position, p.tool, p.tool_class.value) for p in planned],
            cases=[clean],
            skipped=len(cases) - len(chosen),
            seed=seed,
            notes=notes,
        )
        for note in notes:
            self.progress(f"drill: {note}")
        pivot = pivot_of(planned)
        at = f", the pivot at step {pivot}" if pivot else ", no pivot"
        self.progress(f"drill: {len(planned)} steps{at}, {len(chosen)} of {len(cases)} cases")
        for number, fault in enumerate(chosen, 1):
            result = self.play(fault)
            report.cases.append(result)
            verdict = f"{len(result.mismatches)} MISMATCH(ES)" if result.mismatches else "ok"
            self.progress(
                f"[{number}/{len(chosen)}] {fault.name}: {result.end_state}, {verdict} "
                f"({result.seconds:.1f} s)"
            )
        return report

    def _plan(self, steps: list[PlannedStep], clean: CaseResult) -> tuple[list[Fault], list[str]]:
        """Every case of the scenario, and what could not be planned (a driven scenario: its
        steps' and undos' cases; nothing is left out)."""
        return plan(steps, self.saga), []

    def _steps(self, run_id: str) -> list[PlannedStep]:
        picture = self.saga.picture(run_id)
        undos = {int(e["step"]): str(e["tool"]) for e in picture.stack if "step" in e}
        return [
            PlannedStep(position, s.tool, s.tool_class, undos.get(s.step, ""))
            for position, s in enumerate(sorted(picture.steps, key=lambda s: s.step), 1)
        ]

    def play(self, fault: Fault) -> CaseResult:
        """One case: the fault installed, the scenario played, the run's end judged."""
        started = time.monotonic()
        if self.worker is not None and not self.worker.alive():
            self.worker.restart()
        self.faults.clear()
        result = CaseResult(fault)
        try:
            rule = install_rule(self.faults, fault)
            run = self.saga.start_run()
            result.run_id = run.run_id

            def on_call(position: int, handle: StepHandle, args: dict[str, Any]) -> None:
                if position == fault.step:
                    self._strike_step(fault, rule, result, handle, args)

            driven = _DrillRun(run, fault.abort_after, on_call)
            try:
                self.scenario(driven)
            except _Stopped:
                pass
            except Exception as exc:  # the agent saw a failure: the run goes its own way
                result.raised = f"{type(exc).__name__}: {exc}"
            picture = self._end(run, fault, driven, result)
            result.hits = None if rule is None else self.faults.hits(rule)
        finally:
            self.faults.clear()
        return self.conclude(result, picture, started)

    def conclude(self, result: CaseResult, picture: RunPicture, started: float) -> CaseResult:
        """The case judged: its end, whether its fault struck, each step by the world."""
        fault = result.fault
        result.end_state, result.reason = picture.state.value, picture.reason
        if not picture.state.ended:
            what = f"the run did not end within {self.timeout:.0f} s ({picture.state.value})"
            result.mismatch(what, step=0)
        if result.hits is not None and result.hits < fault.nth:
            result.mismatch(
                "the fault never struck (its point was not reached): the case tested nothing"
            )
        if fault.kind in DUPLICATE_KINDS and not result.copy:
            result.mismatch("the message was never delivered twice: the case tested nothing")
        judge(self.saga, picture, result)
        result.seconds = time.monotonic() - started
        return result

    def _strike_step(
        self,
        fault: Fault,
        rule: str | None,
        result: CaseResult,
        handle: StepHandle,
        args: dict[str, Any],
    ) -> None:
        """At the fault's own call: deliver its message again (``delivered_twice``), or wait
        until its effect happened and stop the scenario there (``aborted_mid_effect``; the
        delivery is held after its effect, its outcome not yet recorded)."""
        if fault.kind == "delivered_twice":
            tool = self.saga.registry.get(handle.tool)
            result.copy = f"{handle.run_id}:{handle.step}"
            self.saga.app.send_task(
                tool_task_name(handle.tool),
                kwargs={"run_id": handle.run_id, "step": handle.step, "args": tool.validate(args)},
                task_id=result.copy,
                ignore_result=True,
            )
        elif fault.kind == "aborted_mid_effect" and rule is not None:
            self._until(lambda: self.faults.hits(rule) >= fault.nth)
            raise _Stopped

    def _strike_undo(self, run: Run, step: int, result: CaseResult) -> None:
        """``undo_delivered_twice``: once the undo of ``step`` runs (held after its effect),
        its message again, as the unwind sent it (its id, its owner; not the rest of the
        chain, which the first delivery carries on)."""
        running: list[Any] = []

        def started() -> bool:
            picture = run.picture()
            undo = next((c for c in picture.compensations if c.step == step), None)
            if undo is not None and undo.state is CompensationState.RUNNING and undo.task_id:
                running.append(undo)
            return bool(running) or picture.state.ended

        self._until(started)
        if not running:
            return
        undo = running[0]
        result.copy = undo.task_id
        self.saga.app.send_task(
            tool_task_name(str(undo.entry.get("tool"))),
            kwargs={
                "run_id": run.run_id,
                "compensates": step,
                "unwind": run.core.store.owner(run.run_id),
            },
            task_id=undo.task_id,
            ignore_result=True,
        )

    def _until(self, ready: Callable[[], bool]) -> bool:
        deadline = time.monotonic() + self.timeout
        while time.monotonic() < deadline:
            if ready():
                return True
            time.sleep(_POLL)
        return False

    def _end(self, run: Run, fault: Fault, driven: _DrillRun, result: CaseResult) -> RunPicture:
        """Abort (an abort case) or finish a run the scenario left open; wait for its end
        (and, in a case that delivered a message twice, for the copy to be settled)."""
        try:
            if run.state() is RunState.RUNNING:
                if fault.abort_after and driven.calls >= fault.abort_after:
                    when = "during" if fault.kind == "aborted_mid_effect" else "after"
                    run.abort(f"drill: aborted {when} step {fault.step}")
                    if fault.kind == "undo_delivered_twice" and fault.step <= len(driven.steps):
                        self._strike_undo(run, driven.steps[fault.step - 1], result)
                else:
                    run.finish(timeout=self.timeout)
            picture = run.wait(timeout=self.timeout)
        except SagaError:
            picture = run.picture()
        if result.copy and not self._quiet():
            result.mismatch(f"the broker still held messages {self.timeout:.0f} s after the run")
        return run.picture() if result.copy else picture  # as the copy left it

    def _quiet(self) -> bool:
        """Whether the broker settled every message (the copy included): none waiting, none
        delivered and unacknowledged (``task_acks_late``: a message is acknowledged once its
        task is over). On a broker other than Redis, a pause long enough for a copy to wait
        for the first delivery and replay it."""
        app = self.saga.app
        with app.connection_for_read() as connection:
            if connection.transport.driver_type != "redis":
                time.sleep(2 * HOLD_SECONDS + 1.0)
                return True
            channel: Any = connection.default_channel
            queues = {app.conf.task_default_queue or "celery", TURN_QUEUE}

            def settled() -> bool:
                # (``_size`` counts every priority's list of a queue: kombu's own count.)
                waiting = sum(int(channel._size(queue)) for queue in queues)
                return waiting == 0 and int(channel.client.hlen(channel.unacked_key)) == 0

            return self._until(settled)


def install_rule(faults: Faults, fault: Fault) -> str | None:
    """The fault's rule, written for the workers to meet; its id (None: an abort, no rule).
    The hosted drill's faults on a step are these too."""
    tool, nth, times = faults.tool(fault.tool) if fault.tool else None, fault.nth, fault.times
    if tool is None or fault.kind == "aborted_after":
        return None
    if fault.kind == "fail_before_effect":
        return tool.fail_before_effect(nth=nth, times=times)
    if fault.kind == "fail_after_effect":
        return tool.fail_after_effect(nth=nth, times=times)
    if fault.kind == "killed_mid_effect":
        return tool.kill_worker(at="after_effect", nth=nth)
    if fault.kind in ("delivered_twice", "aborted_mid_effect"):
        return tool.delay(HOLD_SECONDS, at="after_effect", nth=nth)
    if fault.kind == "undo_killed_mid_effect":
        return tool.kill_worker(at="after_compensation", nth=nth)
    if fault.kind == "undo_delivered_twice":
        return tool.delay(HOLD_SECONDS, at="after_compensation", nth=nth)
    after = fault.kind == "undo_fails_after_effect"
    return tool.fail_compensation(times, nth=nth, after_effect=after)
