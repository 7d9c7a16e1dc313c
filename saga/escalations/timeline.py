"""The timeline, drawn as the seed draws it: forward steps with their classes beside the
compensation stack, the pivot line, then the unwind in reverse order with ✓/✗.

One drawing for every place a run is shown (the demo, ``saga show``, the escalation card and
its Markdown): each line is a list of (text, style) segments, so plain text and the terminal
draw the same characters and only the terminal adds colour.
"""

from __future__ import annotations

from typing import Any

from saga.escalations.schema import CompensationDoc, RunDoc, StepDoc, UndoDoc

#: A run of text and the rich style it is drawn in ('' for none).
Segment = tuple[str, str]
Line = list[Segment]

OK, FAIL, DOUBT, WAIT, SKIP = "✓", "✗", "?", "…", "·"
#: An effect a person chose to keep (``reversal="ask"``): not undone, on purpose.
KEPT = "="
_INDENT = "   "
_FORWARD_WIDTH = 38
_UNWIND_WIDTH = 52
_WIDTH = 100

_NOTHING_PUSHED = {
    1: "(nothing: reads need no undo)",
    2: "(nothing: convergent, safe to repeat)",
    5: "(nothing: it cannot be undone)",
}


def circled(n: int) -> str:
    """①..⑳ as the seed numbers steps and classes; (21) beyond."""
    return chr(0x2460 + n - 1) if 1 <= n <= 20 else f"({n})"


def call_text(tool: str, args: dict[str, Any], width: int = 60) -> str:
    """``tool(arg=value, ...)``, cut to ``width`` characters so the columns line up."""
    text = f"{tool}({', '.join(f'{k}={v!r}' for k, v in args.items())})"
    return text if len(text) <= width else text[: width - 4] + "...)"


def undo_text(undo: UndoDoc | None, width: int = 60, missing: str = "(undo not recorded)") -> str:
    """An undo as a call, or why there is none: one never built has no call to show."""
    if undo is None:
        return missing
    if undo["broken"]:
        text = f"(no undo: {undo['description']})"
        return text if len(text) <= width else text[: width - 4] + "...)"
    return call_text(undo["tool"], undo["args"], width)


def plain(lines: list[Line]) -> str:
    """The timeline as text (the demo's output, the Markdown's code block)."""
    return "\n".join("".join(text for text, _ in line).rstrip() for line in lines)


def timeline(doc: RunDoc) -> list[Line]:
    """Draw ``doc``: forward steps and their pushes, the pivot, the unwind, how it ended."""
    lines: list[Line] = [
        [(f"{_INDENT}{'FORWARD':<{_FORWARD_WIDTH + 12}}COMPENSATION STACK", "bold")],
        [(_INDENT + "─" * _WIDTH, "dim")],
    ]
    pivot_drawn = False
    for step in doc["steps"]:
        if step["tool_class"] == 5 and not pivot_drawn:
            label = " PIVOT " if doc["pivot_step"] is None else f" PIVOT (step {step['step']}) "
            lines.append(
                [(_INDENT + "─" * 40 + label + "─" * (_WIDTH - 40 - len(label)), "yellow")]
            )
            pivot_drawn = True
        lines.append(_forward(step))
    lines += _unwind(doc)
    lines.append(_ending(doc))
    return lines


def _forward(step: StepDoc) -> Line:
    head = f"{_INDENT}{circled(step['step'])} {call_text(step['tool'], step['args'], 34)}"
    line: Line = [
        (f"{head:<{_FORWARD_WIDTH + 3}}", ""),
        (f"class {circled(step['tool_class'])} ", "dim"),
    ]
    state, tries = step["state"], _attempts(step["attempts"])
    if state == "succeeded":
        line.append((OK, "green"))
        undo = step["undo"]
        if undo is not None and undo["broken"]:
            line.append((f"  push failed: {undo['description']}", "red"))
        elif undo is not None:
            line.append((f"  push: {call_text(undo['tool'], undo['args'], 48)}", ""))
        else:
            line.append((f"  {_NOTHING_PUSHED.get(step['tool_class'], '(nothing pushed)')}", "dim"))
        if step["landed_late"]:
            line.append(("  (landed late)", "yellow"))
    elif state == "failed":
        message = (step["error"] or {}).get("message", "")
        line += [(FAIL, "red"), (f"  FAILS{tries}: {message}", "red")]
    elif state == "in_doubt":
        found = f" (lookup: {step['reconciled']})" if step["reconciled"] else ""
        line += [(DOUBT, "yellow"), (f"  IN DOUBT{tries}{found}", "yellow")]
    elif state == "rejected":
        message = (step["error"] or {}).get("message", "")
        line += [(SKIP, "dim"), (f"  refused, told to the agent: {message}", "dim")]
    elif state in ("skipped", "not_dispatched"):
        line += [(SKIP, "dim"), ("  never ran: the run was already failing", "dim")]
    else:
        line += [(WAIT, "cyan"), (f"  {state}", "cyan")]
    return line


def _attempts(count: int) -> str:
    return f" after {count} attempt(s)" if count else ""


def _unwind(doc: RunDoc) -> list[Line]:
    comps = {c["step"]: c for c in doc["compensations"]}
    if doc["state"] in ("running", "completed"):
        return []  # nothing unwinds: the pushes above are what it would undo
    if doc["pivot_step"] is not None:
        lines: list[Line] = [[("", "")]]
        lines.append(
            [
                (
                    f"{_INDENT}past the pivot (step {doc['pivot_step']}): nothing is unwound",
                    "yellow bold",
                )
            ]
        )
        for entry in doc["stack"]:
            text = undo_text(entry, 50)
            lines.append(
                [
                    (f"{_INDENT}{circled(entry['step'])} {text:<{_UNWIND_WIDTH}}", ""),
                    (SKIP, "dim"),
                    ("  not run: on the stack", "dim"),
                ]
            )
        return lines
    lines = [[("", "")], [(f"{_INDENT}UNWIND (reverse order)", "bold")]]
    rows = 0
    for step in sorted(doc["steps"], key=lambda s: -s["step"]):
        comp = comps.get(step["step"])
        if comp is not None:
            lines.append(_unwind_row(step["step"], comp))
            rows += 1
        elif step["state"] == "succeeded":
            reason = "nothing to undo" if step["tool_class"] in (1, 2) else "not undone"
            mark = (OK, "green") if step["tool_class"] in (1, 2) else (FAIL, "red")
            label = f"{_INDENT}{circled(step['step'])} —"
            lines.append([(f"{label:<{_UNWIND_WIDTH + 5}}", ""), mark, (f"  ({reason})", "dim")])
            rows += 1
    if rows == 0:
        lines.append([(f"{_INDENT}(nothing to undo)", "dim")])
    return lines


def _unwind_row(step: int, comp: CompensationDoc) -> Line:
    undo = comp["undo"]
    text = undo_text(undo, 50, "(its undo, as recorded)")
    line: Line = [(f"{_INDENT}{circled(step)} {text:<{_UNWIND_WIDTH}}", "")]
    state, tries = comp["state"], f"{comp['attempts']} attempt(s)"
    if state == "done":
        line.append((OK, "green"))
        if comp["recorded"]:
            line.append((f"  ({tries})", "dim"))
        else:
            line.append(("  (from the run's record)", "dim"))
    elif state == "failed":
        last = comp["errors"][-1]["message"] if comp["errors"] else ""
        line += [(FAIL, "red"), (f"  ({tries}: {last})" if last else f"  ({tries})", "red")]
    elif state == "running":
        line += [(WAIT, "cyan"), (f"  running ({tries})", "cyan")]
    elif state == "asked":  # its tool's reversal policy: a person decides first
        line += [(WAIT, "yellow"), ("  a person is asked: reverse, keep or later", "yellow")]
    elif state == "kept":
        line += [(KEPT, "yellow"), ("  kept on purpose (a person decided)", "yellow")]
    else:
        line += [(WAIT, "dim"), ("  waiting to run", "dim")]
    return line


def _ending(doc: RunDoc) -> Line:
    state = doc["state"]
    if state in ("running", "unwinding"):
        return [(f"{_INDENT}→ run is {state}", "cyan")]
    reason = f" ({doc['reason']})" if doc["reason"] else ""
    style = {"completed": "green", "compensated": "green", "escalated": "red bold"}.get(state, "")
    return [(f"{_INDENT}→ run ends {state}{reason}", style)]
