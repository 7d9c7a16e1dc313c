"""The store's Lua scripts as Redis runs them: each script's text with the machine's tables
and the prelude's definitions it uses before it.

The store (``saga.store_scripts``) and the asyncio client (``saga.aio_transport``) register
these same texts, so both run the same SHA. Redis builds a script's local functions again on
every call, so a script carries only the prelude's definitions its code names
(``docs/performance.md``, "What a script costs Redis").
"""

from __future__ import annotations

import functools
import re
from importlib import resources

from saga.machine import lua_tables

__all__ = ["script_sources"]

#: Every script of ``saga/lua`` a store loads (the files whose names start with ``_`` are
#: shared parts).
_SCRIPTS = (
    "create",
    "reserve",
    "release",
    "begin_step",
    "record_success",
    "record_failure",
    "record_retry",
    "abort",
    "mark_sent",
    "mark_refused",
    "begin_compensation",
    "record_compensation",
    "conclude",
    "mark_recorded",
    "requeue",
    "resolve",
    "restore",
    "mark_in_doubt",
    "resolve_in_doubt",
    "take_over",
    "ask_model",
    "record_answer",
    "freeze_results",
    "advance_turn",
    "decide_approval",
    "turn_lease",
    "record_refusal",
    "request_approval",
    "expire_approval",
    "count_revival",
    "count_resend",
    "adopt_deadline",
    "decide_reversal",
)

#: The parts a script shares with some others only, after the prelude: the run's conclusion,
#: which the last undo's record makes too when it was judged beforehand.
_SHARED_PARTS = {
    "conclude": ("_conclude_run",),
    "record_compensation": ("_conclude_run",),
}


@functools.cache
def script_sources() -> dict[str, str]:
    """Each script's whole text (the machine's tables and the prelude before it): what both
    the store and the asyncio client (``saga.aio``) register, so they run the same SHA."""
    folder = resources.files("saga") / "lua"
    prelude = _definitions(lua_tables() + "\n" + (folder / "_prelude.lua").read_text())
    sources = {}
    for name in _SCRIPTS:
        parts = [(folder / f"{part}.lua").read_text() for part in _SHARED_PARTS.get(name, ())]
        body = "\n".join([*parts, (folder / f"{name}.lua").read_text()])
        sources[name] = _used(prelude, body) + "\n" + body
    return sources


#: A definition of the prelude a script may go without: ``local function NAME(`` up to the
#: ``end`` at the line's start, or a one-line ``local NAME = ...``.
_DEFINITION = re.compile(r"local (?:function )?(\w+)\b")


def _definitions(prelude: str) -> list[tuple[str, str]]:
    """The prelude in pieces, in order: (name, text) for each definition (with the comment
    lines just above it), ("", text) for whatever is kept in every script."""
    pieces: list[tuple[str, str]] = []
    lines = prelude.splitlines()
    comment: list[str] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("--"):
            comment.append(line)
            i += 1
            continue
        found = _DEFINITION.match(line)
        function = line.startswith("local function ")
        if found is None or not (function or "," not in line.split("=")[0]):
            pieces.append(("", "\n".join([*comment, line])))
        else:
            end = i
            while function and lines[end] != "end":
                end += 1
            pieces.append((found[1], "\n".join([*comment, *lines[i : end + 1]])))
            i = end
        comment = []
        i += 1
    if comment:
        pieces.append(("", "\n".join(comment)))
    return pieces


def _used(prelude: list[tuple[str, str]], body: str) -> str:
    """The prelude as ``body`` needs it: every definition ``body`` names, and every one those
    name, in the prelude's order. Redis builds a script's local functions again on every call,
    which cost a small script a fifth of its time. A name written anywhere but in a
    whole-line comment or as a quoted word ('TIME') keeps its definition, so what is left out
    is never called."""
    needed: set[str] = set()
    text = _code(body)
    while True:
        named = {
            name
            for name, _ in prelude
            if name and name not in needed and re.search(rf"(?<!')\b{name}\b(?!')", text)
        }
        if not named:
            break
        needed |= named
        text = _code("\n".join(piece for name, piece in prelude if name in named))
    return "\n".join(piece for name, piece in prelude if not name or name in needed)


def _code(text: str) -> str:
    """``text`` without its whole-line comments (which name functions they do not call)."""
    return "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("--"))
