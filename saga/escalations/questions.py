"""The questions a run asks a person before a costly reversal (a tool's ``reversal`` policy),
as every surface shows them: what the undo would do, why it asks, since and until when, the
hash an answer carries, and the exact commands that answer it (the CLI's and the API's).

An escalation names the other side too: a question nobody answered in time failed its undo
(``NotAnswered``), which is why the run escalated.
"""

from __future__ import annotations

import json
import re
import shlex
from collections.abc import Sequence
from datetime import UTC, datetime

from saga.escalations.schema import AnswerCommandsDoc, CompensationDoc, QuestionDoc
from saga.model import CompensationState
from saga.picture import CompensationRecord, RunPicture

#: The error the reaper records on an undo whose question expired unanswered.
NOT_ANSWERED = "NotAnswered"
_DEADLINE = re.compile(r"by (\d{9,}(?:\.\d+)?)$")
#: Why a person is asked, for an undo pushed before the reason was kept with it.
_POLICY_ASKS = "its tool's reversal policy asks a person before reversing this effect"


def _iso(timestamp: float | None) -> str | None:
    if timestamp is None:
        return None
    return datetime.fromtimestamp(timestamp, UTC).isoformat(timespec="seconds")


def question_docs(picture: RunPicture) -> list[QuestionDoc]:
    """The undos of ``picture`` waiting for a person's answer, newest step first (the order
    the unwind reaches them)."""
    asked = [c for c in picture.compensations if c.state is CompensationState.ASKED]
    return [question_doc(c) for c in sorted(asked, key=lambda c: -c.step)]


def question_doc(undo: CompensationRecord) -> QuestionDoc:
    """What a person is (or was) asked about ``undo``."""
    return {
        "step": undo.step,
        "tool": str(undo.entry.get("tool", "")),
        "args": dict(undo.entry.get("args") or {}),
        "description": str(undo.entry.get("description", "")),
        "why": str(undo.entry.get("ask_why") or _POLICY_ASKS),
        "asked_at": _iso(undo.asked_at),
        "until": _iso(undo.ask_expires),
        "args_hash": undo.ask_hash,
        "decisions": list(undo.decisions),
    }


def answer_commands(run_id: str, question: QuestionDoc, command: str = "saga") -> AnswerCommandsDoc:
    """How to answer ``question`` from a shell: ``saga reversal`` (``command``: how ``saga``
    is invoked here) or the HTTP API (``$SAGA_API``: where ``saga serve`` listens;
    ``$SAGA_TOKEN``: an ``operate`` token)."""
    run, step, digest = shlex.quote(run_id), question["step"], question["args_hash"]
    answer = f"{command} reversal {run} {step}"
    body = json.dumps({"decision": "keep", "args_hash": digest, "note": "why it stays"})
    return {
        "step": step,
        "show": f"{command} reversal {run}",
        "reverse": f"{answer} --reverse --hash {digest}",
        "keep": f"{answer} --keep --note {shlex.quote('why it stays, for the books')} "
        f"--hash {digest}",
        "later": f"{answer} --later --hash {digest}",
        "api": (
            'curl -X POST -H "Authorization: Bearer $SAGA_TOKEN" -H "Content-Type: '
            f'application/json" -d {shlex.quote(body)} '
            f'"$SAGA_API/api/runs/{run_id}/reversals/{step}"'
        ),
    }


def unanswered(failed: Sequence[CompensationDoc]) -> list[CompensationDoc]:
    """The failed undos whose question expired with nobody answering it."""
    return [c for c in failed if c["errors"] and c["errors"][-1]["type"] == NOT_ANSWERED]


def unanswered_text(comp: CompensationDoc) -> str:
    """One line naming an expired question, as the card, the Markdown and the console say it."""
    undo = comp["undo"]
    what = f"{undo['tool']}({json.dumps(undo['args'], ensure_ascii=False)})" if undo else "?"
    message = comp["errors"][-1]["message"] if comp["errors"] else ""
    # The reaper's message gives the deadline on the Redis clock: say it as a date.
    message = _DEADLINE.sub(lambda m: f"by {_iso(float(m.group(1)))}", message)
    return (
        f"step {comp['step']}: {what}: {message or 'a person was asked and did not answer'}. "
        "The effect is still live: a requeue asks the question again; resolve once decided "
        "by hand."
    )
