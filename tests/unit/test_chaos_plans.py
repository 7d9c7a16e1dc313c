"""The chaos run's hosted plans obey the pivot rules the turn enforces, and are reproducible."""

from __future__ import annotations

from tests.reliability.chaos import HOSTED_KINDS, KINDS, WRITES, digest, make_plans, parse


def test_the_same_seed_gives_the_same_plans_and_another_seed_others() -> None:
    assert digest(make_plans(300, 7, 0.25)) == digest(make_plans(300, 7, 0.25))
    assert digest(make_plans(300, 7, 0.25)) != digest(make_plans(300, 8, 0.25))
    assert sum(w for _, w in KINDS) == sum(w for _, w in HOSTED_KINDS) == 100


def test_hosted_turns_cover_the_steps_in_order_and_keep_writes_away_from_the_pivot() -> None:
    plans = [p for p in make_plans(2000, 3, 0.5) if "hosted" in p]
    assert 800 < len(plans) < 1200
    early = long = 0
    for plan in plans:
        tools = [s["tool"] for s in plan["steps"]]
        hosted = plan["hosted"]
        turns = hosted["turns"]
        assert 2 <= len(turns) <= 5
        long += len(turns) == 5
        assert [s for t in turns for s in t] == list(range(1, len(tools) + 1))
        for t, steps in enumerate(turns):
            puts = [plan["steps"][s - 1]["args"]["slot"] for s in steps if tools[s - 1] == "put"]
            assert len(puts) == len(set(puts)), "two puts on one slot in parallel"
            if "notify" in (tools[s - 1] for s in steps):
                # nothing written beside the irreversible call, in its turn
                assert all(tools[s - 1] not in WRITES - {"notify"} for s in steps)
                if hosted["early"] is not None:
                    early += 1
                    assert hosted["early"]["turn"] == t
                    assert any(tools[s - 1] in WRITES - {"notify"} for s in turns[t - 1])
        if hosted["give_up"] is not None:
            assert 2 <= hosted["give_up"] <= len(turns) + 1
        assert "abort_after" not in plan["agent"] and "abandon_after" not in plan["agent"]
    assert early > 100 and long < len(plans) / 20


def test_every_store_and_broker_leg_is_a_choice() -> None:
    for store in ("redis", "sentinel", "cluster"):
        for broker in ("redis", "amqp"):
            args = parse(["--store", store, "--broker", broker])
            assert (args.store, args.broker) == (store, broker)
    assert parse(["--store", "cluster"]).failover_every == 20.0
