"""The package as JSON (for scripts) and as Markdown (to paste in a ticket).

The Markdown holds what the card shows, in the same order, with the timeline as a code block
(drawn by ``timeline``) so it survives any ticket system's font.
"""

from __future__ import annotations

import json
from typing import Any

from saga.escalations.questions import unanswered, unanswered_text
from saga.escalations.schema import CompensationDoc, EscalationDoc, RunDoc, RunJsonDoc
from saga.escalations.timeline import plain, timeline, undo_text

#: A cell longer than this is cut (the JSON has it whole).
_CELL = 160


def to_json(doc: EscalationDoc | RunJsonDoc | dict[str, Any]) -> str:
    """Stable: keys in schema order, non-ASCII kept, two-space indent."""
    return json.dumps(doc, indent=2, ensure_ascii=False, default=str)


def database_why(run: RunDoc) -> str:
    """Why a run was read from the database rather than from its live keys."""
    if run.get("redis_unreachable"):
        return "Redis did not answer (what is live there is not shown)"
    return "its Redis keys have expired"


def compact(value: Any, width: int = _CELL) -> str:
    """A value as one line of JSON, cut to ``width``."""
    text = json.dumps(value, ensure_ascii=False, default=str, separators=(", ", ": "))
    return text if len(text) <= width else text[: width - 1] + "…"


def _cell(value: Any) -> str:
    text = value if isinstance(value, str) else compact(value)
    text = text.replace("\\", "\\\\").replace("|", "\\|").replace("\n", " ")
    return text if len(text) <= _CELL else text[: _CELL - 1] + "…"


def _code(value: Any) -> str:
    text = _cell(value)
    return f"`{text}`" if text and "`" not in text else text


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return lines


def run_markdown(doc: RunDoc) -> list[str]:
    """The run's timeline and steps: the part of the package about the run itself."""
    lines = ["### Timeline", "", "```text", plain(timeline(doc)), "```", "", "### Steps", ""]
    rows = [
        [
            str(s["step"]),
            _code(s["tool"]),
            f"{s['tool_class']} ({s['class_name']})",
            _code(s["args"]),
            _code(s["result"]) if s["state"] == "succeeded" else _cell(_step_outcome(s)),
            str(s["attempts"]),
            s["state"],
        ]
        for s in doc["steps"]
    ]
    header = ["#", "tool", "class", "arguments", "result", "attempts", "state"]
    lines += _table(header, rows) if rows else ["(no steps)"]
    return lines


def _step_outcome(step: Any) -> str:
    error = step["error"] or {}
    return f"{error.get('type', '')}: {error.get('message', '')}".strip(": ")


def _failed(comp: CompensationDoc) -> list[str]:
    undo = comp["undo"]
    what = undo_text(undo, 80)
    if undo and undo["broken"]:
        verdict = "Never ran: the compensation could not be built, so there is no undo to run."
    else:
        verdict = f"Gave up after {comp['attempts']} attempt(s) in {comp['rounds']} round(s)" + (
            f"; idempotency key `{undo['idempotency_key']}`." if undo else "."
        )
    lines = [f"#### Step {comp['step']}: `{what}`", "", verdict, ""]
    rows = [
        [str(e["attempt"] or ""), e["at"] or "", _cell(e["type"]), _cell(e["message"])]
        for e in comp["errors"]
    ]
    lines += _table(["attempt", "at", "error", "message"], rows) if rows else ["(no error kept)"]
    return [*lines, ""]


def to_markdown(doc: EscalationDoc) -> str:
    """The whole package, for a ticket: why, the timeline, steps, stack, failed undos, what is
    live, and the commands."""
    state = "open" if doc["open"] else f"resolved: {doc['resolution']}"
    run = doc["run"]
    lines = [
        f"## Escalation `{doc['escalation_id']}`: {doc['why']['reason'] or doc['why']['kind']}",
        "",
        f"**Why:** {doc['why']['summary']}",
        "",
        f"- **State:** {state}",
        f"- **Kind:** {', '.join([doc['why']['kind'], *doc['why']['also']])}",
    ]
    if doc["cause"]:
        lines.append(f"- **Cause:** {doc['cause']}")
    lines += [
        f"- **Run:** `{doc['run_id']}` ({run['state']}, created {run['created_at'] or '?'}, "
        f"escalated {doc['created_at'] or '?'}, generation {doc['generation']}; "
        f"read from {run['source']}"
        + (f": {database_why(run)})" if run["source"] == "database" else ")"),
    ]
    if doc["moved_on"]:
        lines.append(f"- **Since:** {doc['moved_on']}")
    lines += _questions(doc)
    lines += ["", *run_markdown(run), "", "### Stack (captured references)", ""]
    stack_rows = [
        [
            str(e["step"]),
            _code(e["tool"]),
            _code(e["args"]),
            _code(e["idempotency_key"]),
            _cell(e["description"]),
        ]
        for e in doc["stack"]
    ]
    header = ["step", "undo", "arguments", "idempotency key", "description"]
    lines += _table(header, stack_rows) if stack_rows else ["(empty)"]
    lines += ["", "### Failed compensations", ""]
    for comp in doc["failed_compensations"]:
        lines += _failed(comp)
    if not doc["failed_compensations"]:
        lines += ["(none)", ""]
    lines += ["### Still live in the world", ""]
    live_rows = [
        [str(i["step"]), _code(i["tool"]), _code(i["result"]), _cell(i["why"])] for i in doc["live"]
    ]
    lines += _table(["step", "tool", "result", "why"], live_rows) if live_rows else ["(nothing)"]
    lines += ["", "### Commands", "", "```sh"]
    lines += _command_lines(doc)
    lines += ["```", ""]
    return "\n".join(lines)


def _questions(doc: EscalationDoc) -> list[str]:
    """What a person is asked now, with the commands that answer it; and each question that
    expired unanswered."""
    lines: list[str] = []
    answers = {a["step"]: a for a in doc["commands"]["answer_reversal"]}
    for q in doc["run"]["questions"]:
        lines += [
            "",
            f"### A person decides: reverse step {q['step']}? ({_cell(q['description'])})",
            "",
            f"- **Undo:** `{q['tool']}` {_code(q['args'])}",
            f"- **Why asked:** {q['why']}",
            f"- **Asked:** {q['asked_at'] or '?'}; **answer before:** {q['until'] or '?'}",
            f"- **Hash:** `{q['args_hash']}`",
        ]
        answer = answers.get(q["step"])
        if answer is not None:
            lines += ["", "```sh", f"{answer['reverse']}  # reverse it now"]
            lines += [f"{answer['keep']}  # keep the effect, saying why"]
            lines += [f"{answer['later']}  # ask again later", answer["api"], "```"]
    for comp in unanswered(doc["failed_compensations"]):
        lines += ["", f"- **Asked and not answered:** {unanswered_text(comp)}"]
    return lines


def _command_lines(doc: EscalationDoc) -> list[str]:
    commands = doc["commands"]
    lines = []
    if commands["requeue"]:
        lines.append(f"{commands['requeue']}  # once the cause is fixed: run the undos again")
    if commands["requeue_with_correction"]:
        lines.append(f"{commands['requeue_with_correction']}  # with an undo's argument changed")
    if commands["resolve"]:
        lines.append(f"{commands['resolve']}  # dealt with by hand")
    lines.append(f"{commands['show']}  # the run as it is now")
    return lines
