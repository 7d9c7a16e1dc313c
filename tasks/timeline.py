"""Render a run as the seed draws it: forward steps beside the stack, the pivot, the unwind."""

from __future__ import annotations

from typing import Any

from saga import CompensationState, EscalationRecord, RunPicture, StepState, ToolClass
from tasks import systems

OK, FAIL = "✓", "✗"
_RULE = "─" * 100


def circled(n: int) -> str:
    return chr(0x2460 + n - 1) if 1 <= n <= 20 else f"({n})"


def call_text(tool: str, args: dict[str, Any], width: int = 60) -> str:
    """``tool(arg=value, ...)``, cut to ``width`` characters so the columns line up."""
    text = f"{tool}({', '.join(f'{k}={v!r}' for k, v in args.items())})"
    return text if len(text) <= width else text[: width - 4] + "...)"


def _stack_column(picture: RunPicture, step: int, tool_class: ToolClass) -> str:
    entry = next((e for e in picture.compensations if e.step == step), None)
    if entry is not None:
        return "push: " + call_text(entry.entry["tool"], entry.entry["args"])
    if tool_class is ToolClass.READ:
        return "(nothing: reads need no undo)"
    if tool_class is ToolClass.IRREVERSIBLE_WRITE:
        return "(nothing: it cannot be undone)"
    return "(nothing: convergent, safe to repeat)"


def render(picture: RunPicture) -> list[str]:
    lines = [f"   {'FORWARD':<50} COMPENSATION STACK", f"   {_RULE}"]
    pivot_drawn = False
    for step in picture.steps:
        if step.tool_class is ToolClass.IRREVERSIBLE_WRITE and not pivot_drawn:
            lines.append(f"   {'─' * 40} PIVOT {'─' * 55}")
            pivot_drawn = True
        head = f"{circled(step.step)} {call_text(step.tool, step.args, 36)}"
        klass = f"class {circled(int(step.tool_class))}"
        if step.state is StepState.SUCCEEDED:
            lines.append(
                f"   {head:<38} {klass} {OK}  {_stack_column(picture, step.step, step.tool_class)}"
            )
        else:
            error = (step.error or {}).get("message", step.state.value)
            tries = f" after {step.attempts} attempt(s)" if step.attempts else ""
            lines.append(f"   {head:<38} {klass} {FAIL}  FAILS{tries}: {error}")
    done = [c for c in picture.compensations if c.state is not CompensationState.PENDING]
    if picture.pivot_step is None and picture.steps:
        lines += ["", "   UNWIND (reverse order)"]
        for comp in sorted(done, key=lambda c: c.settled_at or 0.0):
            mark = OK if comp.state is CompensationState.DONE else FAIL
            note = f"{comp.attempts} attempt(s)"
            if comp.state is CompensationState.FAILED and comp.error:
                note += f": {comp.error['message']}"
            text = call_text(comp.entry["tool"], comp.entry["args"], 50)
            lines.append(f"   {circled(comp.step)} {text:<52} {mark}  ({note})")
        if not picture.compensations:
            lines.append("   (nothing to undo)")
    elif picture.pivot_step is not None and picture.state.value == "escalated":
        lines += ["", f"   past the pivot (step {picture.pivot_step}): nothing is unwound"]
    ending = picture.state.value + (f" ({picture.reason})" if picture.reason else "")
    lines.append(f"   → run ends {ending}")
    return lines


def render_escalation(escalation: EscalationRecord) -> list[str]:
    lines = [f"   ESCALATION {escalation.escalation_id}: {escalation.reason}"]
    if escalation.cause:
        lines.append(f"     cause:          {escalation.cause}")
    steps = ", ".join(f"{s['step']} {s['tool']}" for s in escalation.steps_done)
    lines.append(f"     steps done:     {steps}")
    for item in escalation.not_undone:
        lines.append(f"     still live:     step {item['step']} {item['tool']}: {item['why']}")
    for comp in escalation.failed_compensations:
        error = (comp.get("error") or {}).get("message", "")
        lines.append(f"     failed undo:    {comp['undo']['description']} ({error})")
    for entry in escalation.stack:
        lines.append(f"     on the stack:   {entry['description']}")
    return lines


def render_systems() -> list[str]:
    snapshot = systems.snapshot()
    lines = ["   billing ledger:"]
    for entry in snapshot["ledger"]:
        reverses = (
            f" (reverses #{entry['reverses_entry_id']})" if entry["reverses_entry_id"] else ""
        )
        amount = entry["amount_cents"] / 100
        lines.append(f"     #{entry['entry_id']} {entry['kind']:<8} {amount:>+12,.2f}{reverses}")
    if not snapshot["ledger"]:
        lines.append("     (no entries)")
    net = sum(e["amount_cents"] for e in snapshot["ledger"]) / 100
    lines.append(f"     net credited: {net:,.2f}")
    for ticket in snapshot["tickets"]:
        lines.append(f"   ticket {ticket['ticket_id']}: {ticket['status']}")
    outgoing = [f"{m['channel']} to {m['recipient']}" for m in snapshot["outbox"]]
    lines.append(f"   outbox: {', '.join(outgoing) or '(nothing sent)'}")
    return lines
