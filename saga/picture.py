"""What a run looks like when read back from Redis: its steps, its stack, its compensations.

Read-only values, so the rules, the records and the people looking at an escalation all see
the same snapshot, taken at one version of the run.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from saga import payload
from saga.model import CompensationState, RunState, StepState, ToolClass

#: The run hash's field holding the requeue that made generation N (by, corrections); its
#: time and count sit beside it (``requeue:N:at``, ``requeue:N:count``).
_REQUEUE_FIELD = re.compile(r"requeue:(\d+)")


@dataclass(frozen=True)
class RunView:
    """What the dispatcher needs to judge a call, read at one version of the run."""

    run_id: str
    state: RunState
    version: str
    pivot_step: int | None
    in_flight: dict[int, ToolClass]
    allow_after_pivot: bool


@dataclass(frozen=True)
class StepRecord:
    """One step as recorded: its call, its state and what came of it."""

    step: int
    tool: str
    tool_class: ToolClass
    args: dict[str, Any]
    state: StepState
    attempts: int
    result: Any = None
    error: dict[str, Any] | None = None
    #: For a step that was in doubt: what its lookup found ("happened", "not_happened", ...).
    reconciled: str = ""
    #: When its latest delivery started running (Redis clock), if one did.
    started: float | None = None
    #: Until when that delivery may still be running (its lease, Redis clock).
    lease: float | None = None
    #: "late" when its effect landed after the step had been judged failed or in doubt.
    landed: str = ""
    #: For a step a hosted turn dispatched: ``<turn>:<call>``, which call of which answer.
    call: str = ""


@dataclass(frozen=True)
class CompensationRecord:
    """One undo on the stack and what became of it."""

    step: int
    entry: dict[str, Any]
    state: CompensationState
    #: Every attempt ever made, across requeues.
    attempts: int
    error: dict[str, Any] | None = None
    #: When it was confirmed done (or given up on), Redis clock.
    settled_at: float | None = None
    #: The Celery task that last ran it (what Flower shows, what ``revoke`` takes).
    task_id: str = ""
    #: Attempts made before the latest requeue: the current round's budget starts after them.
    round_start: int = 0
    #: Earlier rounds, oldest first: ``{"attempts", "error", "at"}`` as each was given up on.
    history: list[dict[str, Any]] = field(default_factory=list)
    #: Until when its current execution may still be running (Redis clock).
    lease: float | None = None
    #: The error of each failed attempt, oldest first, across requeues (the last 20):
    #: ``{"error": {"type", "message", "attempt"}, "at": "<Redis clock>"}``.
    errors: list[dict[str, Any]] = field(default_factory=list)
    #: While ``asked``: until when a person may answer, and the hash binding the answer to
    #: this very undo (``saga.operations.decide_reversal``).
    ask_expires: float | None = None
    ask_hash: str = ""
    #: When the question was (last) asked, Redis clock: how long the unwind has waited.
    asked_at: float | None = None
    #: Every answer about reversing it (``decision``, ``by``, ``note``, ``at``), oldest first.
    decisions: list[dict[str, Any]] = field(default_factory=list)


@dataclass(frozen=True)
class RunPicture:
    """Everything known about a run: what a person handed an escalation needs to see."""

    run_id: str
    state: RunState
    reason: str
    pivot_step: int | None
    steps: list[StepRecord]
    stack: list[dict[str, Any]]
    compensations: list[CompensationRecord]
    created: float
    ended: float | None
    extra: dict[str, str] = field(default_factory=dict)
    #: Last change, and how long the run may go without one before the reaper steps in.
    updated: float = 0.0
    deadline: float = 0.0
    #: Why the run must end escalated whatever its unwind does (a step left in doubt).
    doubt: str = ""
    in_flight: tuple[int, ...] = ()
    version: str = ""
    #: What set a failing run on its way ("step 4 failed", "aborted: ..."), once ``reason``
    #: holds the verdict ("compensation failed", ...).
    cause: str = ""
    #: True once the SQL record of an ended run matches this version (its keys may expire).
    recorded: bool = False
    #: The latest version these keys ended at (their conclusion) or saw recorded in SQL
    #: (``"0"``: neither yet); None for keys written before it was kept. Keys older than their
    #: record lack it: the store went back in time (``saga.divergence``).
    recorded_version: str | None = None
    #: A hosted agent's loop, as stored (``saga.constants.agent_key``); empty for a run driven
    #: by ``run.call``. ``saga.agents.turn_state`` reads it.
    agent: dict[str, str] = field(default_factory=dict)
    #: Requeues made since the run's keys were created (or rebuilt from its record), oldest
    #: first: ``{"kind": "requeue", "generation", "by", "at", "count", "corrections"}``. They
    #: live here so they reach SQL with the run's record even if writing them at once failed.
    actions: tuple[dict[str, Any], ...] = ()
    #: A person's resolution of the current escalation (``by``, ``note``, ``escalation_id``,
    #: ``at``), only while the run is still at the version it was resolved at: an effect that
    #: lands later reopens the escalation.
    resolution: dict[str, Any] | None = None

    def step(self, number: int) -> StepRecord:
        return next(s for s in self.steps if s.step == number)

    @property
    def generation(self) -> int:
        """How many times it was requeued."""
        return int(self.extra.get("generation") or 0)

    def concluded(self, state: RunState, answer: Sequence[Any]) -> RunPicture:
        """This run as the conclusion judged on it left it: ``answer`` is what the conclusion
        wrote (``_conclude_run.lua``: the version, the end's time, the reason, the cause), so
        the run is known as it ended without being read again."""
        version, ended, reason, cause = (str(v) for v in answer[:4])
        return replace(
            self,
            state=state,
            reason=reason,
            cause=cause,
            ended=float(ended),
            updated=float(ended),
            version=version,
            recorded=False,
            resolution=None,  # a resolution holds only at the version it was made at
        )


def picture_from(
    run_id: str,
    run: dict[str, str],
    steps: dict[str, str],
    stack: list[str],
    comps: dict[str, str],
    inflight: list[str],
    agent: dict[str, str] | None = None,
) -> RunPicture:
    """Build the picture from the run's raw Redis hashes (read in one transaction)."""
    return RunPicture(
        run_id=run_id,
        state=RunState(run["state"]),
        reason=run.get("reason", ""),
        pivot_step=int(run["pivot"]) if run.get("pivot") else None,
        steps=_steps_from(steps, int(run.get("next_step", 0))),
        stack=[payload.loads(e) for e in stack],
        compensations=_compensations_from(comps),
        created=float(run["created"]),
        ended=float(run["ended"]) if run.get("ended") else None,
        extra={k: run[k] for k in ("owner", "sent", "generation") if k in run},
        updated=float(run.get("updated") or run["created"]),
        deadline=float(run.get("deadline") or 0),
        doubt=run.get("doubt", ""),
        in_flight=tuple(sorted(int(s) for s in inflight)),
        version=run.get("version", ""),
        cause=run.get("cause", ""),
        recorded=run.get("recorded") == "1",
        recorded_version=run.get("recorded_version"),
        agent=dict(agent or {}),
        actions=_actions_from(run),
        resolution=_resolution_from(run),
    )


def _actions_from(run: dict[str, str]) -> tuple[dict[str, Any], ...]:
    actions = []
    for name, value in run.items():
        matched = _REQUEUE_FIELD.fullmatch(name)
        if matched is None:
            continue
        generation = int(matched[1])
        actions.append(
            {
                "kind": "requeue",
                "generation": generation,
                **payload.loads(value),
                "at": float(run.get(f"{name}:at") or 0),
                "count": int(run.get(f"{name}:count") or 0),
            }
        )
    return tuple(sorted(actions, key=lambda a: int(a["generation"])))


def _resolution_from(run: dict[str, str]) -> dict[str, Any] | None:
    if not run.get("resolved") or run["resolved"] != run.get("version"):
        return None
    return {**payload.loads(run["resolution"]), "at": float(run["resolved_at"])}


def hashes_of(
    picture: RunPicture,
) -> tuple[dict[str, str], dict[str, str], list[str], dict[str, str]]:
    """The run's hash, steps hash, stack and compensations hash as ``picture_from`` reads them
    back: what rebuilding a run from its SQL record writes to Redis. The inverse of
    ``picture_from`` for everything but the in-flight set and the agent's hash (an ended run
    has nothing in flight, and a hosted run's transcript stays in SQL)."""
    steps: dict[str, str] = {}
    for s in picture.steps:
        n = s.step
        steps.update(
            {
                f"{n}:tool": s.tool,
                f"{n}:class": str(int(s.tool_class)),
                f"{n}:args": _json(s.args),
                f"{n}:state": s.state.value,
                f"{n}:attempts": str(s.attempts),
            }
        )
        optional = {
            "result": None if s.result is None else _json(s.result),
            "error": None if s.error is None else _json(s.error),
            "reconciled": s.reconciled,
            "started": _time(s.started),
            "lease": _time(s.lease),
            "landed": s.landed,
            "call": s.call,
        }
        steps.update({f"{n}:{k}": v for k, v in optional.items() if v})
        if s.call:
            steps[f"call:{s.call}"] = str(n)
    comps: dict[str, str] = {}
    for c in picture.compensations:
        n = c.step
        comps.update(
            {
                f"{n}:entry": _json(c.entry),
                f"{n}:state": c.state.value,
                f"{n}:attempts": str(c.attempts),
                f"{n}:round_start": str(c.round_start),
                f"{n}:history": _json(c.history),
            }
        )
        optional = {
            "error": None if c.error is None else _json(c.error),
            "at": _time(c.settled_at),
            "task_id": c.task_id,
            "lease": _time(c.lease),
            "errors": _json(c.errors) if c.errors else "",
            "decisions": _json(c.decisions) if c.decisions else "",
        }
        comps.update({f"{n}:{k}": v for k, v in optional.items() if v})
    # A stack entry is the very string its compensation holds: the done script removes it by
    # value (LREM), so the two must match byte for byte.
    stack = [comps.get(f"{e['step']}:entry") or _json(e) for e in picture.stack]
    run = {
        "state": picture.state.value,
        "version": picture.version or "0",
        "next_step": str(max((s.step for s in picture.steps), default=0)),
        "pivot": "" if picture.pivot_step is None else str(picture.pivot_step),
        "reason": picture.reason,
        "cause": picture.cause,
        "owner": picture.extra.get("owner", ""),
        "sent": picture.extra.get("sent", "0"),
        "generation": picture.extra.get("generation", "0"),
        "created": repr(picture.created),
        "updated": repr(picture.updated),
        "ended": _time(picture.ended),
        "allow_after_pivot": "0",
        "deadline": repr(picture.deadline),
        "doubt": picture.doubt,
        "recorded": "1" if picture.recorded else "",
    }
    # Keys rebuilt from a record saw it written (``Core.behind_records``).
    if picture.recorded_version is not None:
        run["recorded_version"] = picture.recorded_version
    elif picture.recorded:
        run["recorded_version"] = picture.version or "0"
    for action in picture.actions:
        name = f"requeue:{action['generation']}"
        run[name] = _json({"by": action["by"], "corrections": action["corrections"]})
        run[f"{name}:at"] = repr(float(action["at"]))
        run[f"{name}:count"] = str(action["count"])
    if picture.resolution is not None:
        kept = {k: v for k, v in picture.resolution.items() if k != "at"}
        run.update(
            resolved=run["version"],
            resolution=_json(kept),
            resolved_at=repr(float(picture.resolution["at"])),
        )
    return run, steps, stack, comps


def _json(value: Any) -> str:
    return payload.dumps(value, what="record", limit=1 << 62)


def _time(moment: float | None) -> str:
    return "" if moment is None else repr(moment)


def _number(fields: dict[str, str], name: str) -> float | None:
    value = fields.get(name)
    return float(value) if value else None


def _steps_from(fields: dict[str, str], count: int) -> list[StepRecord]:
    steps = []
    for n in range(1, count + 1):
        if f"{n}:tool" not in fields:
            continue
        steps.append(
            StepRecord(
                step=n,
                tool=fields[f"{n}:tool"],
                tool_class=ToolClass(int(fields[f"{n}:class"])),
                args=payload.loads(fields[f"{n}:args"]),
                state=StepState(fields[f"{n}:state"]),
                attempts=int(fields.get(f"{n}:attempts", 0)),
                result=payload.loads(fields.get(f"{n}:result")),
                error=payload.loads(fields.get(f"{n}:error") or None),
                reconciled=fields.get(f"{n}:reconciled", ""),
                started=_number(fields, f"{n}:started"),
                lease=_number(fields, f"{n}:lease"),
                landed=fields.get(f"{n}:landed", ""),
                call=fields.get(f"{n}:call", ""),
            )
        )
    return steps


def _compensations_from(fields: dict[str, str]) -> list[CompensationRecord]:
    numbers = sorted({int(k.split(":")[0]) for k in fields})
    return [
        CompensationRecord(
            step=n,
            entry=payload.loads(fields[f"{n}:entry"]),
            state=CompensationState(fields[f"{n}:state"]),
            attempts=int(fields.get(f"{n}:attempts", 0)),
            error=payload.loads(fields.get(f"{n}:error") or None),
            settled_at=_number(fields, f"{n}:at"),
            task_id=fields.get(f"{n}:task_id", ""),
            round_start=int(fields.get(f"{n}:round_start") or 0),
            history=payload.loads(fields.get(f"{n}:history") or "[]"),
            lease=_number(fields, f"{n}:lease"),
            errors=payload.loads(fields.get(f"{n}:errors") or "[]"),
            ask_expires=_number(fields, f"{n}:ask_expires"),
            ask_hash=fields.get(f"{n}:ask_hash", ""),
            asked_at=_number(fields, f"{n}:asked_at"),
            decisions=payload.loads(fields.get(f"{n}:decisions") or "[]"),
        )
        for n in numbers
    ]
