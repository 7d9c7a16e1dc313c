"""The hosted loop's durable state: one hash per run (``saga.constants.agent_key``) beside the
run's own keys, under its hash tag, expiring with them once the run's record is written.

What is recorded, and who may write it: a turn's answer (first writer wins, in one script
with its usage), the refusal of a call (first writer wins), the results a turn's calls
returned (first writer wins, frozen before the next model call reads them) and "turn k is
done" (first writer wins: the one that wins enqueues the next turn). The step each call got
is recorded by the dispatcher's own reserve script, in the steps hash (``call:<k>:<i>``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
from dataclasses import dataclass, field
from typing import Any

from saga import payload
from saga.agents.messages import ModelTurn, ToolCall, ToolResult, Usage
from saga.agents.transcript import Transcript
from saga.constants import agent_key, call_marker
from saga.effects import PROBLEMS
from saga.errors import PayloadError, RunEndedError
from saga.model import RunState, StepState
from saga.picture import RunPicture, StepRecord
from saga.stack import RunStore, reachable
from saga.turn_scripts import AskerFence

_TURN_FIELD = re.compile(r"^(\d+):(answer|results|advanced|asked)$")
_CALL_FIELD = re.compile(r"^(\d+):(\d+):(refused|approval|decision)$")


@dataclass(frozen=True)
class LoopState:
    """The agent hash of one run, parsed."""

    agent: str
    input: str
    answers: dict[int, ModelTurn] = field(default_factory=dict)
    results: dict[int, tuple[ToolResult, ...]] = field(default_factory=dict)
    refused: dict[tuple[int, int], str] = field(default_factory=dict)
    advanced: dict[int, str] = field(default_factory=dict)
    #: Policy calls per turn (more than one only after a retryable error or a crash).
    asked: dict[int, int] = field(default_factory=dict)
    #: Calls waiting for a person, and the decisions taken, by (turn, call).
    approvals: dict[tuple[int, int], dict[str, Any]] = field(default_factory=dict)
    decisions: dict[tuple[int, int], dict[str, Any]] = field(default_factory=dict)
    model_calls: int = 0
    usage: Usage = field(default_factory=Usage)
    size: int = 0
    ended: str = ""
    #: What the end asked for ("finish" or "unwind"), carried out by whoever finds it undone.
    end: str = ""
    revived: int = 0
    #: The run's deadline is a web app's default, for the agent's own to replace.
    deadline_open: bool = False

    @classmethod
    def parse(cls, fields: dict[str, str]) -> LoopState | None:
        """None for a run with no agent (driven by ``run.call``)."""
        if "name" not in fields:
            return None
        answers: dict[int, ModelTurn] = {}
        results: dict[int, tuple[ToolResult, ...]] = {}
        advanced: dict[int, str] = {}
        asked: dict[int, int] = {}
        refused: dict[tuple[int, int], str] = {}
        approvals: dict[tuple[int, int], dict[str, Any]] = {}
        decisions: dict[tuple[int, int], dict[str, Any]] = {}
        for name, value in fields.items():
            if match := _TURN_FIELD.match(name):
                turn, kind = int(match[1]), match[2]
                if kind == "answer":
                    answers[turn] = ModelTurn.from_dict(json.loads(value))
                elif kind == "results":
                    results[turn] = tuple(ToolResult.from_dict(r) for r in json.loads(value))
                elif kind == "asked":
                    asked[turn] = int(value)
                else:
                    advanced[turn] = value
            elif match := _CALL_FIELD.match(name):
                where, kind = (int(match[1]), int(match[2])), match[3]
                if kind == "refused":
                    refused[where] = value
                else:
                    (approvals if kind == "approval" else decisions)[where] = json.loads(value)
        return cls(
            agent=fields["name"],
            input=fields.get("input", ""),
            answers=answers,
            results=results,
            refused=refused,
            advanced=advanced,
            asked=asked,
            approvals=approvals,
            decisions=decisions,
            model_calls=int(fields.get("model_calls") or 0),
            usage=Usage(int(fields.get("tokens_in") or 0), int(fields.get("tokens_out") or 0)),
            size=int(fields.get("bytes") or 0),
            ended=fields.get("ended", ""),
            end=fields.get("end", ""),
            revived=int(fields.get("revived") or 0),
            deadline_open=fields.get("deadline_open") == "1",
        )

    @property
    def current_turn(self) -> int:
        """The first turn not done yet."""
        return max(self.advanced, default=0) + 1

    def pending_approvals(self) -> list[dict[str, Any]]:
        """Calls of the current turn that wait for a person's decision."""
        turn = self.current_turn
        return [
            {"id": call_marker(*where), **request}
            for where, request in sorted(self.approvals.items())
            if where[0] == turn and where not in self.decisions and where not in self.refused
        ]


def args_hash(call: ToolCall) -> str:
    """What an approval is bound to: the tool and its exact arguments, canonically."""
    text = json.dumps({"tool": call.name, "arguments": call.arguments}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()


def call_steps(picture: RunPicture) -> dict[str, StepRecord]:
    """The steps hosted turns dispatched, by their call marker ``<turn>:<call>``."""
    return {s.call: s for s in picture.steps if s.call}


def result_of(call: ToolCall, step: StepRecord | None, refused: str | None) -> ToolResult | None:
    """What call ``call`` tells the model, or None while its step has not settled."""
    if refused is not None:
        return ToolResult.failure(call.id, refused)
    if step is None:
        return None
    message = (step.error or {}).get("message", "")
    if step.state is StepState.SUCCEEDED and (step.error or {}).get("type") in PROBLEMS:
        # The effect happened, but the result recorded is a placeholder (``saga.effects``).
        return ToolResult.failure(call.id, f"{call.name} ran, but {message}")
    if step.state is StepState.SUCCEEDED:
        return ToolResult(call.id, step.result)
    if step.state is StepState.REJECTED:
        return ToolResult.failure(call.id, message or f"{call.name} was rejected")
    if step.state is StepState.FAILED:
        return ToolResult.failure(call.id, f"{call.name} failed: {message}")
    if step.state in (StepState.SKIPPED, StepState.NOT_DISPATCHED):
        return ToolResult.failure(call.id, f"{call.name} was not run ({step.state.value})")
    if step.state is StepState.IN_DOUBT:  # judged, yet nobody could tell (the run is failing)
        return ToolResult.failure(call.id, f"whether {call.name} happened is unknown")
    return None  # dispatched or running: not settled yet


def turn_results(picture: RunPicture, state: LoopState, turn: int) -> tuple[ToolResult, ...] | None:
    """The results of ``turn``'s calls from the recorded steps; None while one is unsettled."""
    answer = state.answers.get(turn)
    if answer is None:
        return None
    if turn in state.results:
        return state.results[turn]
    steps = call_steps(picture)
    results = []
    for i, call in enumerate(answer.calls):
        step = steps.get(call_marker(turn, i))
        if step is not None and step.step in picture.in_flight:
            return None
        result = result_of(call, step, state.refused.get((turn, i)))
        if result is None:
            return None
        results.append(result)
    return tuple(results)


def transcript_until(state: LoopState, turn: int) -> Transcript:
    """The conversation the model sees at the start of ``turn``: the input, then every earlier
    answer with its (frozen) results."""
    transcript = Transcript()
    transcript.add_user(state.input)
    for k in range(1, turn):
        answer = state.answers[k]
        transcript.add_turn(answer)
        if answer.calls:
            transcript.add_results(state.results[k])
    return transcript


def consecutive_refusals(state: LoopState, before: int) -> int:
    """Error results in a row at the end of the turns before ``before``."""
    count = 0
    for k in range(1, before):
        for result in state.results.get(k, ()):
            count = count + 1 if result.is_error else 0
    return count


def document(picture: RunPicture) -> dict[str, Any] | None:
    """The hosted run as JSON, for ``saga.client.get_run`` and the SQL record: the input,
    each turn (its answer, raw response and usage, and what its calls returned, frozen or
    as the steps stand), the totals."""
    state = LoopState.parse(picture.agent)
    if state is None:
        return None
    steps = call_steps(picture)
    turns = []
    for k in sorted(state.answers):
        answer = state.answers[k]
        results = turn_results(picture, state, k)
        calls = []
        for i, call in enumerate(answer.calls):
            step = steps.get(call_marker(k, i))
            calls.append(
                {
                    "id": call.id,
                    "name": call.name,
                    "arguments": call.arguments,
                    "step": step.step if step else None,
                    "refused": state.refused.get((k, i)),
                }
            )
        turns.append(
            {
                "turn": k,
                "text": answer.text,
                "calls": calls,
                "results": None if results is None else [r.to_dict() for r in results],
                "usage": dataclasses.asdict(answer.usage),
                "stop_reason": answer.stop_reason,
                "raw": answer.raw,
            }
        )
    return {
        "agent": state.agent,
        "input": state.input,
        "turns": turns,
        "pending_approvals": state.pending_approvals() if picture.state is RunState.RUNNING else [],
        "usage": dataclasses.asdict(state.usage),
        "model_calls": state.model_calls,
        "ended": state.ended,
    }


class TurnStore:
    """Writes of the hosted loop, each first-writer-wins."""

    def __init__(
        self, store: RunStore, max_payload_bytes: int, max_transcript_bytes: int = 0
    ) -> None:
        self.store = store
        self.client = store.client
        self.limit = max_payload_bytes
        #: The results of one turn together may fill what is left of the transcript: each
        #: is within ``max_payload_bytes`` already, and a turn may make several calls.
        self.results_limit = max(max_transcript_bytes, max_payload_bytes)

    def record_answer(
        self, run_id: str, turn: int, answer: ModelTurn, token: str = ""
    ) -> ModelTurn:
        """Record ``answer`` unless one is recorded already; return the one recorded. An answer
        too large to keep loses its raw response first (the format rebuilds it)."""
        try:
            text = payload.dumps(answer.to_dict(), what="the model's answer", limit=self.limit)
        except PayloadError:
            slim = dataclasses.replace(answer, raw={})
            text = payload.dumps(slim.to_dict(), what="the model's answer", limit=self.limit)
        usage = answer.usage
        outcome = self.store.record_answer(
            run_id, turn, text, len(answer.calls), usage.input_tokens, usage.output_tokens, token
        )
        if outcome.status == "ended":  # ended while the model thought: nothing to keep
            raise RunEndedError(run_id, str(outcome.values[0]))
        if outcome.status not in ("ok", "dup"):
            raise PayloadError(f"run {run_id} has no agent state ({outcome.status})")
        return ModelTurn.from_dict(json.loads(outcome.values[0]))

    def ask_model(
        self,
        run_id: str,
        turn: int,
        lease_seconds: float,
        token: str,
        most: int = 0,
        fence: AskerFence | None = None,
    ) -> str:
        """Take the turn's lease and count the model call (one step): only one delivery of a
        turn asks the model at a time, and a redelivery while a slow model still answers the
        first must wait for its answer, not ask again. ``record_answer`` releases it."""
        return self.store.ask_model(run_id, turn, lease_seconds, token, most, fence)

    def release_lease(self, run_id: str, turn: int, token: str) -> None:
        """For a model call that ended without an answer to record."""
        self.store.release_turn_lease(run_id, turn, token)

    def request_approval(self, run_id: str, turn: int, call: int, tool_call: ToolCall) -> None:
        """Ask a person: the exact call and its hash; the script stamps when (Redis clock)."""
        request = {
            "tool": tool_call.name,
            "arguments": tool_call.arguments,
            "args_hash": args_hash(tool_call),
        }
        text = payload.dumps(request, what="an approval request", limit=self.limit)
        self.store.request_approval(run_id, call_marker(turn, call), text)

    def record_refusal(self, run_id: str, turn: int, call: int, message: str) -> None:
        self.store.record_refusal(run_id, call_marker(turn, call), message[:2000])

    def freeze_results(
        self, run_id: str, turn: int, results: tuple[ToolResult, ...]
    ) -> tuple[ToolResult, ...]:
        """The results turn ``turn`` returns to the model, as first recorded."""
        what = f"the results of turn {turn}"
        text = payload.dumps([r.to_dict() for r in results], what=what, limit=self.results_limit)
        stored = self.store.freeze_results(run_id, turn, text)
        return tuple(ToolResult.from_dict(r) for r in json.loads(stored))

    def mark_ended(self, run_id: str, turn: int, why: str, end: str) -> tuple[str, str]:
        """The loop stops at ``turn``: why and what to do (``finish`` or ``unwind``), first
        writer wins, and the turn is done with. Returns the end recorded (why, what)."""
        key = agent_key(run_id)
        with reachable("mark_ended"), self.client.pipeline(transaction=True) as pipe:
            pipe.hsetnx(key, "ended", why)
            pipe.hsetnx(key, "end", end)
            pipe.hsetnx(key, f"{turn}:advanced", why)
            pipe.hmget(key, ["ended", "end"])
            recorded = pipe.execute()[-1]
        return str(recorded[0] or why), str(recorded[1] or end)

    def count_revival(self, run_id: str) -> int:
        return self.store.count_revival(run_id)
