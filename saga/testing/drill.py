"""``saga drill``: replay one scenario once per fault and judge each run by the world.

A scenario is a Python function that takes a ``Run`` and makes its calls, as an agent loop
would (``run.call(...).result(...)``). One clean run discovers its steps; then each case
installs one fault (``saga.testing.Faults``, acted on by a real worker) and plays the scenario
again: each step failing before its effect, after it (every attempt: the lookup's path), killed
mid-effect (redelivery); each undo failing once before its effect, once after it, and always;
the run aborted after each step.

Each case is judged by what the tools' systems say, not by saga's own word: a tool's
``verify`` (``tools.tool(..., verify=...)``) reads the system and says whether the effect made
under a step's idempotency key is live, and how many times; without one, its ``lookup`` says
whether it happened at all. A compensation's ``verify`` counts how often the undo was applied.
``saga.testing.drill_report`` renders the result.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from saga.constants import compensation_idempotency_key, step_idempotency_key
from saga.errors import SagaError
from saga.model import CompensationState, RunState, StepState, ToolClass
from saga.runs import Run
from saga.testing.faults import Faults

if TYPE_CHECKING:
    from saga.engine import Saga
    from saga.picture import RunPicture
    from saga.runs import StepHandle
    from saga.testing.processes import WorkerProcess

#: A scripted, driven run: it makes its calls on the run it is given (and may finish it).
Scenario = Callable[["Run"], Any]
#: Told one line per case as the drill goes.
Progress = Callable[[str], None]

#: Every kind of fault, in the order the cases are planned.
KINDS = (
    "fail_before_effect",
    "fail_after_effect",
    "killed_mid_effect",
    "undo_fails_once",
    "undo_fails_after_effect",
    "undo_fails_always",
    "aborted_after",
)
#: What a kind means, for the reports.
MEANINGS = {
    "none": "the clean run",
    "fail_before_effect": "the step fails before its effect, every attempt",
    "fail_after_effect": "the step's effect happens, then it fails, every attempt",
    "killed_mid_effect": "the worker dies after the effect, before the outcome: redelivery",
    "undo_fails_once": "the undo fails once before its effect",
    "undo_fails_after_effect": "the undo's effect happens, then it fails once: retried",
    "undo_fails_always": "the undo fails every attempt",
    "aborted_after": "the run is aborted after this step",
}


class DrillError(SagaError):
    """The drill could not run: the scenario made no steps, or its clean run failed."""


@dataclass(frozen=True)
class Fault:
    """One fault of one case: its kind, the step (position) it strikes and its tool."""

    kind: str
    step: int = 0
    tool: str = ""
    #: Which call of ``tool`` (at its fault point) it strikes, from 1; and for how many calls.
    nth: int = 1
    times: int = 1
    #: Abort the run once this many calls were made (0: let the scenario run to its end).
    abort_after: int = 0

    @property
    def name(self) -> str:
        return (
            "clean run" if self.kind == "none" else f"{self.kind} @ step {self.step} ({self.tool})"
        )


@dataclass(frozen=True)
class StepOutcome:
    """One write step of a case: what saga reports and what the world says."""

    step: int
    tool: str
    #: saga's word: "undone", "live", "escalated" (live in an escalated run), "in_doubt",
    #: "none" (failed, skipped: no effect).
    saga: str
    #: The world's: how many times the effect is live (``verify``), whether it happened
    #: (``lookup``: 1 or 0), or None (the tool declares neither).
    world: int | None
    source: str
    #: How many times its undo was applied (the compensation's ``verify``), or None.
    undo_applied: int | None = None


@dataclass(frozen=True)
class Mismatch:
    fault: str
    tool: str
    step: int
    what: str

    def __str__(self) -> str:
        return f"{self.fault}: step {self.step} ({self.tool}): {self.what}"


@dataclass
class CaseResult:
    fault: Fault
    run_id: str = ""
    end_state: str = ""
    reason: str = ""
    #: What the scenario raised (a failed step's error, as the agent saw it).
    raised: str = ""
    steps: list[StepOutcome] = field(default_factory=list)
    mismatches: list[Mismatch] = field(default_factory=list)
    seconds: float = 0.0
    #: How many times the fault's point was reached (None: the case installs no rule).
    hits: int | None = None


@dataclass
class DrillReport:
    scenario: str
    #: The clean run's steps: (position, tool, class).
    steps: list[tuple[int, str, int]]
    cases: list[CaseResult]
    #: Cases planned but left out by ``max_cases``.
    skipped: int = 0
    seed: int = 0

    @property
    def mismatches(self) -> list[Mismatch]:
        return [m for case in self.cases for m in case.mismatches]

    @property
    def ok(self) -> bool:
        return not self.mismatches


@dataclass(frozen=True)
class _PlannedStep:
    position: int
    tool: str
    tool_class: ToolClass
    undo_tool: str


class _Stopped(BaseException):
    """Ends the scenario where an abort case aborts it (not an ``Exception``: a scenario's own
    ``except Exception`` must not swallow it)."""


class _DrillRun(Run):
    """The ``Run`` the scenario gets: the real one, aborted once ``abort_after`` calls were
    made (before the next call, or when the scenario finishes)."""

    def __init__(self, run: Run, abort_after: int) -> None:
        super().__init__(run.core, run.run_id)
        self.on_failure = run.on_failure
        self._abort_after = abort_after
        self.calls = 0

    def call(self, tool: str, /, **args: Any) -> StepHandle:
        self._maybe_stop()
        self.calls += 1
        return super().call(tool, **args)

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
    ) -> None:
        self.saga = saga
        #: Started again before a case if a fault took it down.
        self.worker = worker
        self.scenario = scenario
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
        name = getattr(self.scenario, "__qualname__", repr(self.scenario))
        if clean.end_state != RunState.COMPLETED.value or clean.mismatches:
            why = clean.raised or clean.reason or "; ".join(map(str, clean.mismatches))
            raise DrillError(f"the clean run of {name} ended {clean.end_state}: {why}")
        planned = self._steps(clean.run_id)
        if not planned:
            raise DrillError(f"{name} made no calls")
        cases = [f for f in plan(planned, self.saga) if f.kind in wanted]
        chosen = sample(cases, max_cases, seed)
        report = DrillReport(
            scenario=name,
            steps=[(p.position, p.tool, p.tool_class.value) for p in planned],
            cases=[clean],
            skipped=len(cases) - len(chosen),
            seed=seed,
        )
        self.progress(f"drill: {len(planned)} steps, {len(chosen)} of {len(cases)} cases")
        for number, fault in enumerate(chosen, 1):
            result = self.play(fault)
            report.cases.append(result)
            verdict = f"{len(result.mismatches)} MISMATCH(ES)" if result.mismatches else "ok"
            self.progress(
                f"[{number}/{len(chosen)}] {fault.name}: {result.end_state}, {verdict} "
                f"({result.seconds:.1f} s)"
            )
        return report

    def _steps(self, run_id: str) -> list[_PlannedStep]:
        picture = self.saga.picture(run_id)
        undos = {int(e["step"]): str(e["tool"]) for e in picture.stack if "step" in e}
        return [
            _PlannedStep(position, s.tool, s.tool_class, undos.get(s.step, ""))
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
            rule = _install(self.faults, fault)
            run = self.saga.start_run()
            result.run_id = run.run_id
            driven = _DrillRun(run, fault.abort_after)
            try:
                self.scenario(driven)
            except _Stopped:
                pass
            except Exception as exc:  # the agent saw a failure: the run goes its own way
                result.raised = f"{type(exc).__name__}: {exc}"
            picture = self._end(run, fault, driven.calls)
            result.hits = None if rule is None else self.faults.hits(rule)
        finally:
            self.faults.clear()
        result.end_state, result.reason = picture.state.value, picture.reason
        if not picture.state.ended:
            what = f"the run did not end within {self.timeout:.0f} s ({picture.state.value})"
            result.mismatches.append(Mismatch(fault.name, "", 0, what))
        if result.hits is not None and result.hits < fault.nth:
            what = "the fault never struck (its point was not reached): the case tested nothing"
            result.mismatches.append(Mismatch(fault.name, fault.tool, fault.step, what))
        judge(self.saga, picture, result)
        result.seconds = time.monotonic() - started
        return result

    def _end(self, run: Run, fault: Fault, calls: int) -> RunPicture:
        """Abort (an abort case) or finish a run the scenario left open; wait for its end."""
        try:
            if run.state() is RunState.RUNNING:
                if fault.abort_after and calls >= fault.abort_after:
                    run.abort(f"drill: aborted after step {fault.step}")
                else:
                    run.finish(timeout=self.timeout)
            return run.wait(timeout=self.timeout)
        except SagaError:
            return run.picture()


def plan(steps: Sequence[_PlannedStep], saga: Saga) -> list[Fault]:
    """Every case of a scenario whose clean run made ``steps``."""
    faults: list[Fault] = []
    seen: dict[str, int] = {}
    for s in steps:
        seen[s.tool] = nth = seen.get(s.tool, 0) + 1
        attempts = saga.registry.get(s.tool).retry.attempts
        faults.append(Fault("fail_before_effect", s.position, s.tool, nth, attempts))
        if s.tool_class.is_write:
            faults.append(Fault("fail_after_effect", s.position, s.tool, nth, attempts))
            faults.append(Fault("killed_mid_effect", s.position, s.tool, nth))
    # The undos run when the run is aborted after the last step before the pivot (a class 5
    # step), newest first: the nth undo of a tool is counted from that end.
    pivot = next((s.position for s in steps if s.tool_class is ToolClass.IRREVERSIBLE_WRITE), 0)
    last = pivot - 1 if pivot else len(steps)
    undone = [s for s in steps if s.position <= last and s.undo_tool]
    for s in undone:
        nth = 1 + sum(1 for o in undone if o.position > s.position and o.undo_tool == s.undo_tool)
        attempts = saga.registry.get(s.undo_tool).retry.attempts
        at = (s.position, s.undo_tool, nth)
        faults.append(Fault("undo_fails_once", *at, abort_after=last))
        faults.append(Fault("undo_fails_after_effect", *at, abort_after=last))
        faults.append(Fault("undo_fails_always", *at, times=attempts, abort_after=last))
    for s in steps:
        faults.append(Fault("aborted_after", s.position, s.tool, abort_after=s.position))
    order = {kind: i for i, kind in enumerate(KINDS)}
    return sorted(faults, key=lambda f: (order[f.kind], f.step))


def sample(cases: list[Fault], max_cases: int | None, seed: int) -> list[Fault]:
    """``max_cases`` of ``cases`` drawn with ``seed``, in their planned order."""
    if max_cases is None or max_cases >= len(cases):
        return list(cases)
    picked = sorted(random.Random(seed).sample(range(len(cases)), max(0, max_cases)))
    return [cases[i] for i in picked]


def _install(faults: Faults, fault: Fault) -> str | None:
    """The fault's rule, written for the workers to meet; its id (None: an abort, no rule)."""
    tool, nth, times = faults.tool(fault.tool) if fault.tool else None, fault.nth, fault.times
    if tool is None or fault.kind == "aborted_after":
        return None
    if fault.kind == "fail_before_effect":
        return tool.fail_before_effect(nth=nth, times=times)
    if fault.kind == "fail_after_effect":
        return tool.fail_after_effect(nth=nth, times=times)
    if fault.kind == "killed_mid_effect":
        return tool.kill_worker(at="after_effect", nth=nth)
    after = fault.kind == "undo_fails_after_effect"
    return tool.fail_compensation(times, nth=nth, after_effect=after)


def judge(saga: Saga, picture: RunPicture, result: CaseResult) -> None:
    """Each write step of the run, as saga reports it and as its system has it."""
    escalated = picture.state is RunState.ESCALATED
    undos = {c.step: c for c in picture.compensations}
    positions = {s.step: i for i, s in enumerate(sorted(picture.steps, key=lambda s: s.step), 1)}
    for record in picture.steps:
        tool = saga.registry.get(record.tool)
        if not record.tool_class.is_write:
            continue
        undo = undos.get(record.step)
        if undo is not None and undo.state is CompensationState.DONE:
            said = "undone"
        elif record.state is StepState.SUCCEEDED:
            said = "escalated" if escalated else "live"
        elif record.state is StepState.IN_DOUBT:
            said = "in_doubt"
        else:
            said = "none"
        key = step_idempotency_key(picture.run_id, record.step)
        world, source = _world(tool.verify, tool.lookup, key, record.args)
        undo_applied = None
        if undo is not None:
            undo_tool = saga.registry.get(str(undo.entry.get("tool")))
            if undo_tool.verify is not None:
                undo_key = compensation_idempotency_key(picture.run_id, record.step)
                undo_applied = _count(undo_tool.verify(undo_key, undo.entry.get("args") or {}))
        outcome = StepOutcome(
            positions[record.step], record.tool, said, world, source, undo_applied
        )
        result.steps.append(outcome)
        for what in _mismatches(outcome, picture.state, tool.compensation is not None):
            result.mismatches.append(Mismatch(result.fault.name, record.tool, outcome.step, what))


def _world(verify: Any, lookup: Any, key: str, args: dict[str, Any]) -> tuple[int | None, str]:
    try:
        if verify is not None:
            return _count(verify(key, args)), "verify"
        if lookup is not None:
            return (0 if lookup(key, args) is None else 1), "lookup"
    except Exception as exc:  # a system that cannot answer is reported, not guessed at
        return None, f"error: {type(exc).__name__}: {exc}"
    return None, ""


def _count(answer: bool | int) -> int:
    return int(answer)


def _mismatches(step: StepOutcome, state: RunState, compensatable: bool) -> list[str]:
    """What the world says that saga does not (an empty list: they agree)."""
    found: list[str] = []
    n = step.world
    if n is not None and n >= 2:
        found.append(f"the effect was applied {n} times under one idempotency key")
    if step.undo_applied is not None and step.undo_applied >= 2:
        found.append(f"the undo was applied {step.undo_applied} times under one idempotency key")
    if n is None:
        return found
    if step.saga == "undone":
        if step.source == "verify" and n >= 1:  # a lookup finds an undone effect too
            found.append("saga reports it undone, but the effect is live")
    elif step.saga == "none":
        if n >= 1:
            found.append("the effect is live, and saga reports none: nobody will undo it")
    elif step.saga in ("live", "escalated"):
        if n == 0:
            found.append(f"saga reports it {step.saga}, but the system has no such effect")
        elif state is RunState.COMPENSATED and compensatable:
            found.append("a live effect in a run that ended compensated, not escalated")
    return found
