"""The drill's cases on a hosted run's model turns, and its judgment of what the turns did.

``model_differs_on_replay``: a turn's delivery dies once the model answered, before the answer
is recorded (the fault point ``after_model_call``); its redelivery asks the model again, and the
model answers differently (the scenario's variant for the turn, else one the drill makes where
a safe one exists). A real model asked twice may well answer twice differently: the run must
act on the answer it recorded, the second, and on nothing of the first, which no record holds.

The approvals the run asked are judged in every hosted case: a call that needs a person went
out only with an approval bound to its own arguments' hash, which the drill gave having been
shown exactly those arguments (asked again for a new answer, never reused). Plain Python: the
judgment reads a run's picture and what the fake model answered.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from saga.agents.messages import ToolCall
from saga.agents.turn_state import LoopState, args_hash
from saga.model import ToolClass
from saga.testing.drill_judge import CaseResult, Mismatch
from saga.testing.drill_plan import Fault
from saga.testing.fake_models import Answered, ModelFailure, calls_of

if TYPE_CHECKING:
    from saga.engine import Saga
    from saga.picture import RunPicture, StepRecord
    from saga.testing.fake_models import Step

#: A call as the model asked for it: its tool and its arguments.
Call = tuple[str, dict[str, Any]]
#: What the drill appends to a final answer to make the replayed ask's answer differ.
AGAIN = " (answered again)"


def made_variant(step: Step, saga: Saga) -> Step | None:
    """A different answer to a turn asked again that the run can take as safely as ``step``:
    a final answer reworded; parallel calls in the reverse order, when none is irreversible
    (reordered, an irreversible call could go out before a write it followed, which saga
    refuses: another run, not another answer). None where there is none: one call (any other
    call or argument is the scenario's to choose), a failure, a function of the request."""
    if isinstance(step, str):
        return step + AGAIN
    if callable(step) or isinstance(step, ModelFailure):
        return None
    calls = calls_of(step)
    if len(calls) < 2 or calls == calls[::-1]:
        return None
    known = {tool.name: tool for tool in saga.registry}
    for name, _ in calls:
        tool = known.get(name)
        if tool is None or tool.tool_class is ToolClass.IRREVERSIBLE_WRITE:
            return None
    return list(reversed(calls))


def plan_turns(
    agent: str,
    turns: Sequence[int],
    script: Sequence[Step],
    variants: Mapping[int, Step],
    saga: Saga,
) -> tuple[list[Fault], dict[int, Step], list[str]]:
    """One ``model_differs_on_replay`` case per model turn of the clean run that has a variant
    (the scenario's, else one of the drill's making); the variants by turn; and a note for
    each turn left out, saying why."""
    faults: list[Fault] = []
    chosen: dict[int, Step] = {}
    notes: list[str] = []
    for turn in turns:
        if turn > len(script):
            notes.append(f"model_differs_on_replay @ turn {turn}: the script has no answer for it")
            continue
        given = variants.get(turn)
        variant = given if given is not None else made_variant(script[turn - 1], saga)
        if variant is None:
            notes.append(
                f"model_differs_on_replay @ turn {turn} not planned: no safe variant of its "
                "answer (give one: HostedScenario(variants=...), --variants)"
            )
            continue
        answer = script[turn - 1]
        if not callable(variant) and not callable(answer) and _said(variant) == _said(answer):
            notes.append(
                f"model_differs_on_replay @ turn {turn} not planned: its variant is the "
                "answer itself"
            )
            continue
        chosen[turn] = variant
        faults.append(Fault("model_differs_on_replay", tool=agent, nth=turn, turn=turn))
    return faults, chosen, notes


def _said(step: Step) -> tuple[tuple[Call, ...], str]:
    if isinstance(step, str):
        return (), step
    if isinstance(step, ModelFailure):
        return (), f"<{step.status}>"
    return tuple(calls_of(step)), ""


@dataclass
class Approvals:
    """What the drill, as the person, was shown and approved in one case."""

    #: ``(marker, args_hash)`` of every approval given: the hash of the call as shown.
    given: set[tuple[str, str]] = field(default_factory=set)
    #: The markers answered (approved or, the request not matching what was shown, denied).
    answered: set[str] = field(default_factory=set)


def shown_hash(request: Mapping[str, Any]) -> str:
    """The hash of the call a request shows a person (its tool and arguments), as saga binds
    an approval to it: computed from what is shown, not taken from the request."""
    call = ToolCall("", str(request.get("tool")), dict(request.get("arguments") or {}))
    return args_hash(call)


def judge_approvals(
    saga: Saga, picture: RunPicture, agent: str, approvals: Approvals, result: CaseResult
) -> None:
    """Every dispatched call that needs a person: asked for its own arguments, approved for
    them, by the drill, having been shown them."""
    state = LoopState.parse(picture.agent)
    if state is None:
        return
    needs = saga.agents.get(agent).approval
    positions = _positions(picture)
    for record in picture.steps:
        if not record.call or record.tool not in needs:
            continue
        turn, i = (int(n) for n in record.call.split(":"))
        answer = state.answers.get(turn)
        if answer is None or i >= len(answer.calls):
            continue
        want = args_hash(answer.calls[i])
        request = state.approvals.get((turn, i))
        decision = state.decisions.get((turn, i)) or {}
        found = ""
        if request is None:
            found = "it went out, and the run never asked a person"
        elif request.get("args_hash") != want:
            found = "the approval asked is bound to other arguments than the call's"
        elif decision.get("verdict") != "approved" or decision.get("args_hash") != want:
            found = f"it went out without an approval of its arguments ({decision or 'none'})"
        elif (record.call, want) not in approvals.given:
            found = "it went out on an approval the drill never gave for these arguments (reused)"
        if found:
            where = positions.get(record.step, 0)
            result.mismatches.append(Mismatch(result.fault.name, record.tool, where, found))


def judge_replay(
    saga: Saga,
    picture: RunPicture,
    asks: Sequence[Answered],
    result: CaseResult,
) -> None:
    """``model_differs_on_replay`` at ``result.fault.turn``: the model was asked again, the run
    recorded the second answer and ran its calls, each once, and nothing of the first."""
    fault, turn = result.fault, result.fault.turn
    answers = [a for a in asks if not a.failed]

    def found(what: str, record: StepRecord | None = None) -> None:
        at = _positions(picture).get(record.step, 0) if record is not None else 0
        tool = record.tool if record is not None else ""
        result.mismatches.append(Mismatch(fault.name, tool, at, what))

    if len(answers) < 2:
        found(
            f"turn {turn} was not asked again after its answer was lost (the model answered "
            f"{len(answers)} ask(s) for it): the case tested nothing"
        )
        return
    first, second = _of(answers[0]), _of(answers[-1])
    if first == second:
        found(
            f"the model answered turn {turn}'s replayed ask as the first: the case tested nothing"
        )
        return
    state = LoopState.parse(picture.agent)
    recorded = state.answers.get(turn) if state is not None else None
    if recorded is None:
        found(f"turn {turn} has no recorded answer")
        return
    kept = (tuple((c.name, dict(c.arguments)) for c in recorded.calls), recorded.text)
    if kept == first:
        found(f"turn {turn} recorded the first, lost answer ({_show(first)}), not the second")
    elif kept != second:
        found(f"turn {turn} recorded {_show(kept)}, not the replayed ask's {_show(second)}")
    for record in picture.steps:
        if not record.call or int(record.call.split(":")[0]) != turn:
            continue
        i = int(record.call.split(":")[1])
        ran = (record.tool, record.args)
        if i < len(second[0]) and _same(saga, ran, second[0][i]):
            continue
        if i < len(first[0]) and _same(saga, ran, first[0][i]):
            found(f"call {record.call} of the first, lost answer ran: {_show_call(ran)}", record)
        else:
            found(f"call {record.call} ran {_show_call(ran)}, which the second answer never asked")


def _of(answered: Answered) -> tuple[tuple[Call, ...], str]:
    return tuple((name, dict(args)) for name, args in answered.calls), answered.text


def _same(saga: Saga, ran: Call, asked: Call) -> bool:
    """Whether a step ran the call asked: its tool, and its arguments as the tool took them."""
    if ran[0] != asked[0]:
        return False
    try:
        return ran[1] == saga.registry.get(asked[0]).validate(asked[1])
    except Exception:  # arguments the tool refuses: compared as asked
        return ran[1] == asked[1]


def _positions(picture: RunPicture) -> dict[int, int]:
    """Each step's position in the run (as ``drill_judge`` numbers them)."""
    return {s.step: i for i, s in enumerate(sorted(picture.steps, key=lambda s: s.step), 1)}


def _show(said: tuple[tuple[Call, ...], str]) -> str:
    calls, text = said
    return ", ".join(_show_call(c) for c in calls) if calls else repr(text)


def _show_call(call: Call) -> str:
    return f"{call[0]}({call[1]})"
