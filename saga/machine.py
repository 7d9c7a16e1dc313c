"""The three state machines of a run, written down as tables: (state, event) -> state, and who
may cause each move.

The Lua scripts enforce exactly these tables: ``lua_tables()`` renders them into the prelude
every script is loaded with, and a script asked for a move the table does not list refuses it
(``illegal``), which the store logs loudly. So the table here is the one place a transition is
allowed; the model check (``tests/reliability/modelcheck.py``) drives every actor against it.

Replays are not transitions: an event that finds its effect already recorded (a redelivered
success, a second failure of a failed step) answers with what the first call decided.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from saga.model import CompensationState, RunState, StepState


class Actor(StrEnum):
    """Who may cause a move."""

    DISPATCHER = "dispatcher"  # the agent's process, through Saga.dispatch / start_run
    AGENT = "agent"  # run.finish(), run.abort()
    WORKER = "worker"  # a delivery of the step's or compensation's Celery task
    RECONCILER = "reconciler"  # the tool's lookup, asked about a step in doubt
    REAPER = "reaper"  # the periodic reaper (saga.reap)
    REVOKE = "revoke"  # Celery's task_revoked signal
    OWNER = "owner"  # whoever owns the run's unwind (its chain, its conclusion)
    OPERATOR = "operator"  # a person: requeue


@dataclass(frozen=True)
class Move:
    event: str
    source: str
    target: str
    actors: tuple[Actor, ...]
    why: str


def _moves(rows: list[tuple[str, str, str, tuple[Actor, ...], str]]) -> tuple[Move, ...]:
    return tuple(Move(*row) for row in rows)


W, R, RV, D = Actor.WORKER, Actor.REAPER, Actor.REVOKE, Actor.DISPATCHER
S = StepState
#: A step, from its reservation to its outcome. ``late`` sources: an effect that lands on a
#: step already judged is never dropped: it is pushed, and unwound or escalated.
STEP_MOVES = _moves(
    [
        ("begin", S.DISPATCHED, S.RUNNING, (W,), "a delivery starts the tool"),
        ("begin", S.RUNNING, S.RUNNING, (W,), "a redelivery, once the last one's lease ran out"),
        ("skip", S.DISPATCHED, S.SKIPPED, (W,), "the run is failing before the step began"),
        ("release", S.DISPATCHED, S.NOT_DISPATCHED, (D,), "the broker refused the message"),
        ("never_started", S.DISPATCHED, S.FAILED, (R, RV), "no delivery ever began"),
        ("retry", S.RUNNING, S.RUNNING, (W,), "the attempt failed; another is on its way"),
        ("fail", S.RUNNING, S.FAILED, (W,), "the tool failed for good; no effect"),
        ("fail", S.IN_DOUBT, S.FAILED, (W,), "the doubted delivery reports its failure"),
        ("reject", S.RUNNING, S.REJECTED, (W,), "refused by the tool, or a failure fed back"),
        ("reject", S.IN_DOUBT, S.REJECTED, (W,), "the doubted delivery reports a refusal"),
        ("succeed", S.RUNNING, S.SUCCEEDED, (W,), "the effect happened and is recorded"),
        ("succeed", S.IN_DOUBT, S.SUCCEEDED, (W,), "the truth lands on a step in doubt"),
        ("succeed", S.FAILED, S.SUCCEEDED, (W,), "late: it was judged failed, yet landed"),
        ("succeed", S.SKIPPED, S.SUCCEEDED, (W,), "late: a duplicate delivery ran it"),
        ("succeed", S.NOT_DISPATCHED, S.SUCCEEDED, (W,), "late: the refused message arrived"),
        ("succeed", S.REJECTED, S.SUCCEEDED, (W,), "late: judged rejected, yet landed"),
        ("doubt", S.RUNNING, S.IN_DOUBT, (W, R, RV), "it began and nobody will report"),
        ("doubt", S.DISPATCHED, S.IN_DOUBT, (R,), "never begun, says a store that lost it"),
        ("found", S.IN_DOUBT, S.SUCCEEDED, (Actor.RECONCILER,), "the lookup found the effect"),
        ("not_found", S.IN_DOUBT, S.FAILED, (Actor.RECONCILER,), "the lookup found nothing"),
        ("unknown", S.IN_DOUBT, S.IN_DOUBT, (Actor.RECONCILER,), "nothing can tell: escalate"),
    ]
)

C = CompensationState
#: A compensation, from its push to its outcome. A failed one runs again only by a requeue.
COMPENSATION_MOVES = _moves(
    [
        ("begin", C.PENDING, C.RUNNING, (Actor.OWNER,), "the unwind's chain reaches it"),
        ("begin", C.RUNNING, C.RUNNING, (Actor.OWNER,), "a redelivery, once the lease ran out"),
        ("retry", C.RUNNING, C.PENDING, (W,), "the attempt failed; another is on its way"),
        ("done", C.RUNNING, C.DONE, (W,), "the undo happened"),
        ("done", C.PENDING, C.DONE, (W,), "the undo of an attempt that was retried happened"),
        ("fail", C.RUNNING, C.FAILED, (W,), "given up after its retries: escalate"),
        ("fail", C.PENDING, C.FAILED, (Actor.OWNER, W), "it cannot run (broken, no tool)"),
        ("revoke", C.PENDING, C.FAILED, (RV,), "revoked before it ran"),
        ("revoke", C.RUNNING, C.FAILED, (RV,), "revoked while running: it may have happened"),
        ("ask", C.PENDING, C.ASKED, (Actor.OWNER,), "its reversal policy asks a person first"),
        ("reverse", C.ASKED, C.PENDING, (Actor.OPERATOR,), "a person said: reverse it now"),
        ("keep", C.ASKED, C.KEPT, (Actor.OPERATOR,), "a person kept the effect, with a note"),
        ("later", C.ASKED, C.ASKED, (Actor.OPERATOR,), "a person will decide later"),
        ("expire", C.ASKED, C.FAILED, (R,), "nobody answered in time: escalate"),
        ("requeue", C.FAILED, C.PENDING, (Actor.OPERATOR,), "a fresh attempt budget"),
        ("requeue", C.PENDING, C.PENDING, (Actor.OPERATOR,), "landed late on an ended run"),
    ]
)

U = RunState
#: A run. Every terminal state waits for its SQL record before its keys may expire.
RUN_MOVES = _moves(
    [
        ("complete", U.RUNNING, U.COMPLETED, (Actor.AGENT,), "every step settled"),
        ("fail_to_start", U.RUNNING, U.FAILED_TO_START, (W,), "no agent to run it: no step ran"),
        ("fail", U.RUNNING, U.UNWINDING, (W, R, RV), "a step failed or is in doubt"),
        ("abort", U.RUNNING, U.UNWINDING, (Actor.AGENT, R, W), "asked to stop, or abandoned"),
        ("take_over", U.UNWINDING, U.UNWINDING, (R,), "its unwind stalled: a new owner"),
        ("compensate", U.UNWINDING, U.COMPENSATED, (Actor.OWNER,), "everything undone"),
        ("escalate", U.UNWINDING, U.ESCALATED, (Actor.OWNER,), "a person must take over"),
        ("requeue", U.ESCALATED, U.UNWINDING, (Actor.OPERATOR,), "failed undos run again"),
        ("late", U.COMPENSATED, U.UNWINDING, (W,), "an effect landed after: undo it too"),
        ("late", U.COMPLETED, U.ESCALATED, (W,), "an effect landed after: a person looks"),
        ("late", U.ESCALATED, U.ESCALATED, (W,), "an effect landed after: on the card"),
    ]
)

MACHINES: dict[str, tuple[Move, ...]] = {
    "step": STEP_MOVES,
    "comp": COMPENSATION_MOVES,
    "run": RUN_MOVES,
}


def target(machine: str, source: str, event: str) -> str | None:
    """The state ``event`` moves ``source`` to, or None if the table does not allow it."""
    for move in MACHINES[machine]:
        if move.source == source and move.event == event:
            return move.target
    return None


def lua_tables() -> str:
    """The tables as a Lua prelude: one constant string of ``|machine:source:event=target``
    entries, which ``move()`` in ``_prelude.lua`` searches. A string constant is built once,
    when Redis compiles the script; nested tables would be built again on every call (a
    quarter of a small script's time)."""
    entries = "".join(
        f"|{machine}:{m.source}:{m.event}={m.target}"
        for machine, moves in MACHINES.items()
        for m in moves
    )
    return f"local MOVES = '{entries}|'"


def markdown() -> str:
    """The tables as Markdown, for ``docs/state-machines.md`` (a test keeps the two equal)."""
    titles = {"step": "Step", "comp": "Compensation", "run": "Run"}
    parts = [
        "# State machines",
        "",
        "Generated from `saga/machine.py`; the Lua scripts refuse every move not listed here.",
        "",
    ]
    for machine, moves in MACHINES.items():
        parts += [
            f"## {titles[machine]}",
            "",
            "| from | event | to | who | why |",
            "|---|---|---|---|---|",
        ]
        for m in moves:
            who = ", ".join(a.value for a in m.actors)
            parts.append(f"| {m.source} | {m.event} | {m.target} | {who} | {m.why} |")
        parts.append("")
    return "\n".join(parts)
