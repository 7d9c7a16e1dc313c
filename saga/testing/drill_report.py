"""A drill's result as a person or a pull request reads it: a matrix of fault x outcome (plain
text for the terminal, Markdown) and JSON, with every mismatch named."""

from __future__ import annotations

import json
from dataclasses import asdict
from typing import Any

from saga.testing.drill import DrillReport
from saga.testing.drill_judge import CaseResult, StepOutcome
from saga.testing.drill_plan import MEANINGS

#: What a cell's first word means (saga's report of the step).
LEGEND = (
    "cell = saga's word / the world's count: undone, live, esc (live in an escalated run), "
    "doubt, none (no effect); the count is how many times the effect is live (verify) or "
    "whether it happened (lookup, marked ~); xN: the undo was applied N times; ? unknown"
)
_SHORT = {"escalated": "esc", "in_doubt": "doubt"}


def to_json(report: DrillReport) -> dict[str, Any]:
    return {
        "scenario": report.scenario,
        "ok": report.ok,
        "seed": report.seed,
        "skipped": report.skipped,
        "notes": report.notes,
        "steps": [{"step": p, "tool": t, "class": c} for p, t, c in report.steps],
        "pivot": report.pivot,
        "cases": [
            {
                "fault": asdict(case.fault) | {"name": case.fault.name},
                "run_id": case.run_id,
                "end_state": case.end_state,
                "reason": case.reason,
                "raised": case.raised,
                "seconds": round(case.seconds, 2),
                "fault_hits": case.hits,
                "copy": case.copy,
                "steps": [asdict(s) for s in case.steps],
                "mismatches": [str(m) for m in case.mismatches],
            }
            for case in report.cases
        ],
        "mismatches": [asdict(m) | {"message": str(m)} for m in report.mismatches],
    }


def to_json_text(report: DrillReport) -> str:
    return json.dumps(to_json(report), indent=2)


def _cell(outcome: StepOutcome | None) -> str:
    if outcome is None:
        return "-"
    world = "?" if outcome.world is None else str(outcome.world)
    mark = "~" if outcome.source == "lookup" else ""
    undo = f" x{outcome.undo_applied}" if (outcome.undo_applied or 0) >= 2 else ""
    return f"{_SHORT.get(outcome.saga, outcome.saga)}/{mark}{world}{undo}"


def _rows(report: DrillReport) -> tuple[list[str], list[list[str]]]:
    writes = sorted({o.step for case in report.cases for o in case.steps})
    names = {p: t for p, t, _ in report.steps}
    steps = [f"{p} {names.get(p, '?')}{' (pivot)' if p == report.pivot else ''}" for p in writes]
    header = ["fault", "end", *steps, "verdict"]
    rows = []
    for case in report.cases:
        by_step = {o.step: o for o in case.steps}
        verdict = f"MISMATCH ({len(case.mismatches)})" if case.mismatches else "ok"
        cells = [_cell(by_step.get(p)) for p in writes]
        rows.append([case.fault.name, case.end_state or "?", *cells, verdict])
    return header, rows


def _summary(report: DrillReport) -> str:
    n = len(report.cases) - 1
    left = (
        f", {report.skipped} left out (--max-cases, seed {report.seed})" if report.skipped else ""
    )
    found = len(report.mismatches)
    return f"drill of {report.scenario}: {n} fault cases{left}: {found} mismatch(es)"


def to_text(report: DrillReport) -> str:
    header, rows = _rows(report)
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    lines = [
        "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip()
        for row in [header, *rows]
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    lines += ["", LEGEND, "", _summary(report)]
    lines += [f"  MISMATCH {m}" for m in report.mismatches]
    lines += [f"  note: {note}" for note in report.notes]
    return "\n".join(lines)


def to_markdown(report: DrillReport) -> str:
    header, rows = _rows(report)
    verdict = "passed" if report.ok else "**failed**"
    lines = [f"### saga drill: {report.scenario} {verdict}", "", _summary(report), ""]
    lines.append("| " + " | ".join(header) + " |")
    lines.append("|" + "---|" * len(header))
    lines += ["| " + " | ".join(c.replace("|", "\\|") for c in row) + " |" for row in rows]
    lines += ["", f"_{LEGEND}_"]
    if report.mismatches:
        lines += ["", "#### Mismatches", ""]
        lines += [f"- {_described(c)}" for c in report.cases if c.mismatches]
    if report.notes:
        lines += ["", "#### Not planned", ""]
        lines += [f"- {note}" for note in report.notes]
    return "\n".join(lines) + "\n"


def _described(case: CaseResult) -> str:
    what = "; ".join(
        f"step {m.step} ({m.tool}): {m.what}" if m.step or m.tool else m.what
        for m in case.mismatches
    )
    meaning = MEANINGS.get(case.fault.kind, "")
    return f"**{case.fault.name}** ({meaning}; run `{case.run_id}` ended {case.end_state}): {what}"
