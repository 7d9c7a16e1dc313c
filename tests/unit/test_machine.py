"""The transition tables: well formed, rendered into the scripts, and the only moves they make."""

from __future__ import annotations

import re
from importlib import resources

import pytest

from saga import machine
from saga.model import CompensationState, RunState, StepState
from tests.conftest import ROOT

STATES = {"step": StepState, "comp": CompensationState, "run": RunState}
LUA = resources.files("saga") / "lua"


@pytest.mark.parametrize("name", sorted(machine.MACHINES))
def test_each_move_is_between_known_states_and_listed_once(name: str) -> None:
    """No (source, event) pair is listed twice, and every state is one of the model's."""
    moves = machine.MACHINES[name]
    known = {s.value for s in STATES[name]}
    assert all(m.source in known and m.target in known for m in moves)
    pairs = [(m.source, m.event) for m in moves]
    assert len(pairs) == len(set(pairs))
    assert all(m.actors and m.why for m in moves)


def test_ended_runs_move_only_through_requeue_or_a_late_effect() -> None:
    """Completed, compensated and escalated are terminal but for the two documented reopenings."""
    for move in machine.RUN_MOVES:
        if RunState(move.source).ended:
            assert move.event in ("requeue", "late"), move


def test_the_lua_prelude_holds_exactly_the_tables() -> None:
    """Every move of the tables is in the rendered Lua, and nothing else is."""
    rendered = machine.lua_tables()
    found = re.findall(r"\|(\w+):(\w*):(\w+)=(\w+)(?=\|)", rendered)
    expected = [
        (name, m.source, m.event, m.target)
        for name, moves in machine.MACHINES.items()
        for m in moves
    ]
    assert found == expected
    entries = "".join(f"|{name}:{source}:{event}={to}" for name, source, event, to in found)
    assert rendered == f"local MOVES = '{entries}|'"  # and nothing else


def test_every_event_a_script_asks_for_is_in_the_tables() -> None:
    """A script naming an event the table does not know would refuse every call silently."""
    events = {(name, m.event) for name, moves in machine.MACHINES.items() for m in moves}
    asked = set()
    for script in LUA.iterdir():
        text = script.read_text()
        asked |= set(re.findall(r"move\('(\w+)', [^,]+, '(\w+)'\)", text))
    assert asked and asked <= events, asked - events


def test_the_docs_show_the_tables_as_they_are() -> None:
    """docs/state-machines.md is generated from the tables (regenerate with markdown())."""
    assert (ROOT / "docs" / "state-machines.md").read_text() == machine.markdown()


def test_target_answers_none_for_a_move_not_listed() -> None:
    assert machine.target("step", "dispatched", "begin") == "running"
    assert machine.target("step", "succeeded", "fail") is None
    assert machine.target("comp", "done", "begin") is None


def test_the_scripts_find_every_move_of_the_tables_and_no_other(redis_url: str) -> None:
    """``move()`` of the prelude, run by Redis, answers each listed move's target and nothing
    for a pair the tables do not list (one entry is never mistaken for another)."""
    import redis

    prelude = machine.lua_tables() + "\n" + (LUA / "_prelude.lua").read_text()
    ask = prelude + "\nreturn move(ARGV[1], ARGV[2], ARGV[3]) or ''"
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    script = client.register_script(ask)
    keys = [f"saga:{{moves-test}}:{part}" for part in ("a", "b", "c", "d", "e", "f")]
    for name, moves in machine.MACHINES.items():
        for m in moves:
            assert script(keys=keys, args=[name, m.source, m.event]) == m.target, m
    listed = {(name, m.source, m.event) for name, moves in machine.MACHINES.items() for m in moves}
    states = {s for name, moves in machine.MACHINES.items() for m in moves for s in (m.source,)}
    events = {m.event for moves in machine.MACHINES.values() for m in moves}
    for name in machine.MACHINES:
        for source in [*states, "", "runnin", "running:begin"]:
            for event in [*events, "", "begi"]:
                if (name, source, event) not in listed:
                    assert script(keys=keys, args=[name, source, event]) == "", (name, source)
    client.close()
