"""The scripts as Redis runs them: each carries the prelude's definitions it uses and no other,
and the clock writes times as the store has always stored them."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from saga.script_sources import script_sources

LUA = Path(__file__).resolve().parents[2] / "saga" / "lua"
PRELUDE = (LUA / "_prelude.lua").read_text()
#: Every name the prelude defines, read here on its own (not with the store's parser).
DEFINED = set(re.findall(r"^local (?:function )?(\w+)\s*[(=]", PRELUDE, re.M)) | {"MOVES"}


def code_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if not line.lstrip().startswith("--")]


def uses(line: str, name: str) -> bool:
    return re.search(rf"(?<!')\b{name}\b(?!')", line) is not None


@pytest.mark.parametrize("script", sorted(script_sources()))
def test_a_script_defines_every_helper_it_uses_before_its_first_use(script: str) -> None:
    """A helper left out would be a global, which Redis refuses only once that line runs:
    on a path the tests may never take."""
    lines = code_lines(script_sources()[script])
    for name in DEFINED:
        definition = re.compile(rf"^local (?:function )?{name}\b")
        at = next((i for i, line in enumerate(lines) if definition.match(line)), None)
        used = [i for i, line in enumerate(lines) if uses(line, name) and i != at]
        if at is None:
            assert not used, f"{script} uses {name} but does not define it: {lines[used[0]]!r}"
        else:
            assert all(i > at for i in used), f"{script} uses {name} before defining it"


def test_a_script_carries_only_the_helpers_it_uses() -> None:
    """Redis builds a script's local functions again on every call, so an unused one is pure
    cost: the reservation defines none of the unwind's helpers."""
    sources = script_sources()
    reserve = sources["reserve"]
    for helper in ("maybe_own", "still_mine", "push_undo", "advance_turn", "leased", "move"):
        assert f"local function {helper}(" not in reserve
    assert "local function bump_from(" in reserve
    assert "local function push_undo(" in sources["record_success"]
    assert "redis.call('TIME')" not in sources["mark_sent"]  # no time written, none read


def run_clock(redis_url: str, seconds: str, micros: str) -> list[str]:
    """The prelude's clock on a given TIME reply, against the way it formatted times before
    (a number, then ``%.6f``)."""
    import redis

    prelude = script_sources()["begin_step"].split("-- The transition tables")[0]
    assert prelude.count("redis.call('TIME')") == 1
    clock = prelude.replace("redis.call('TIME')", "{ARGV[1], ARGV[2]}")
    check = "return {NOW_S, string.format('%.6f', tonumber(ARGV[1]) + tonumber(ARGV[2]) / 1e6)}"
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    try:
        keys = [f"saga:{{clock-test}}:{part}" for part in ("a", "b", "c", "d", "e", "f", "g")]
        return list(client.eval(clock + "\n" + check, len(keys), *keys, seconds, micros))
    finally:
        client.close()


@pytest.mark.parametrize(
    "micros", ["0", "7", "59", "123456", "999999", "100000", "000001", "500000", "999995"]
)
def test_the_clock_writes_times_as_a_formatted_number_did(redis_url: str, micros: str) -> None:
    """Times are compared and parsed by every reader (the reaper, the listing, the records):
    the digits written from TIME are the ones ``%.6f`` wrote."""
    for seconds in ("1796636193", "1700000000", "2147483647"):
        written, formatted = run_clock(redis_url, seconds, str(int(micros)))
        assert written == formatted, (seconds, micros)
