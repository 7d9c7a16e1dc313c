"""``saga drill`` as a user runs it: the command in a subprocess (its own redis-server and
worker), on the demo's credit scenario, which passes, on a run the session's worker recorded
(``--from-run``), and on ``examples/drill``, whose broken undos it names; and the plugin's
``saga_drill`` fixture in that example's own pytest run."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import ROOT, service_missing
from tests.integration.test_testing_kit import pytest_in

EXAMPLE = ROOT / "examples" / "drill"
SAGA = [sys.executable, "-m", "saga.cli"]

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(autouse=True)
def _redis_server() -> None:
    if shutil.which("redis-server") is None:
        service_missing("redis-server is not installed (Debian: apt-get install redis-server)")


def saga_drill(cwd: Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    """``saga drill ARGS`` in ``cwd``, with none of this session's saga settings."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("SAGA_", "PYTEST_"))}
    return subprocess.run(
        [*SAGA, "drill", *args],
        cwd=cwd,
        env={**clean, **env},
        capture_output=True,
        text=True,
        timeout=150,
        check=False,
    )


def test_the_demo_credit_scenario_passes_a_sampled_drill(tmp_path: Path) -> None:
    # When the credit scenario is drilled, 7 cases sampled with a seed
    args = ["--app", "tasks.app:saga", "--scenario", "tasks.scenarios:credit_refund"]
    args += ["--max-cases", "7", "--seed", "4", "--json", str(tmp_path / "drill.json")]
    done = saga_drill(ROOT, *args, SAGA_DEMO_DATA=str(tmp_path / "data"))

    # Then every case agrees with the world, and the JSON says which were played
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-3000:]
    assert "0 mismatch(es)" in done.stdout
    report = json.loads((tmp_path / "drill.json").read_text())
    assert report["ok"] is True and report["skipped"] == 30 - 7
    assert len(report["cases"]) == 8  # the clean run and 7 faults
    assert "[7/7]" in done.stderr  # progress, one line per case


def test_the_drill_names_the_broken_undos_and_exits_non_zero(tmp_path: Path) -> None:
    # When the example's booking is drilled on its aborts and its undos failing after effect
    args = ["--app", "trips.app:saga", "--scenario", "trips.scenario:book_trip"]
    args += ["--fault", "aborted_after", "--fault", "undo_fails_after_effect"]
    done = saga_drill(EXAMPLE, *args, "--markdown", str(tmp_path / "drill.md"))

    # Then it fails, naming the fault, the tool and the effect
    assert done.returncode == 1, done.stdout[-4000:] + done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert (
        "  MISMATCH aborted_after @ step 3 (charge_card): step 2 (charge_card): "
        "saga reports it undone, but the effect is live"
    ) in lines
    assert (
        "  MISMATCH undo_fails_after_effect @ step 1 (release_seat): step 1 (hold_seat): "
        "the undo was applied 2 times under one idempotency key"
    ) in lines
    markdown = (tmp_path / "drill.md").read_text()
    assert "**failed**" in markdown and "#### Mismatches" in markdown


def test_the_new_kinds_catch_the_undo_that_is_not_idempotent(tmp_path: Path) -> None:
    # When the example is drilled on deliveries twice, kills of an undo and aborts mid-effect
    args = ["--app", "trips.app:saga", "--scenario", "trips.scenario:book_trip"]
    for kind in ("delivered_twice", "undo_killed_mid_effect", "undo_delivered_twice"):
        args += ["--fault", kind]
    args += ["--fault", "aborted_mid_effect", "--json", str(tmp_path / "drill.json")]
    done = saga_drill(EXAMPLE, *args)

    # Then the release, run again after its worker died past its effect, gave the seat back
    # twice; and the refund of the latest charge, aborted while the balance was charged, left
    # the deposit live
    assert done.returncode == 1, done.stdout[-4000:] + done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert (
        "  MISMATCH undo_killed_mid_effect @ step 1 (release_seat): step 1 (hold_seat): "
        "the undo was applied 2 times under one idempotency key"
    ) in lines
    assert (
        "  MISMATCH aborted_mid_effect @ step 3 (charge_card): step 2 (charge_card): "
        "saga reports it undone, but the effect is live"
    ) in lines
    cases = {
        c["fault"]["name"]: c for c in json.loads((tmp_path / "drill.json").read_text())["cases"]
    }
    # A copy delivered while the first delivery holds the lease waits and replays: the
    # steps' effects and the release are applied once, the copy's id is in the report
    for name, case in cases.items():
        if name.startswith("delivered_twice"):
            assert case["mismatches"] == [] and case["copy"], case
            assert case["fault_hits"] >= case["fault"]["nth"], case  # held: the copy came then
    twice = cases["undo_delivered_twice @ step 1 (release_seat)"]
    assert ":1:undo:" in twice["copy"]
    assert next(s for s in twice["steps"] if s["step"] == 1)["undo_applied"] == 1


def test_a_recorded_run_is_drilled_from_its_id(
    demo_app: Any, worker: Any, saga_env: dict[str, str], redis_client: Any, tmp_path: Path
) -> None:
    from tasks.scenarios import credit_refund

    # Given a run of the credit scenario, recorded, whose Redis keys have since gone
    run = demo_app.saga.start_run()
    credit_refund(run)
    assert run.wait(timeout=30).state.value == "completed"
    for key in redis_client.scan_iter(f"*{run.run_id}*"):
        redis_client.delete(key)

    # When it is drilled from its id, the world set up before each case
    args = ["--app", "tasks.app:saga", "--from-run", run.run_id, "--setup", "tasks.systems:reset"]
    args += ["--fault", "delivered_twice", "--fault", "aborted_after"]
    args += ["--json", str(tmp_path / "drill.json")]
    deployment = {k: saga_env[k] for k in ("SAGA_REDIS_URL", "SAGA_DATABASE_URL")}
    done = saga_drill(ROOT, *args, SAGA_DEMO_DATA=str(tmp_path / "data"), **deployment)

    # Then its four recorded calls were the scenario, and every case agrees with the world
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-3000:]
    report = json.loads((tmp_path / "drill.json").read_text())
    assert report["scenario"] == f"run {run.run_id}" and report["pivot"] == 4
    assert [s["tool"] for s in report["steps"]] == [
        "get_order",
        "issue_credit",
        "set_ticket_status",
        "send_reply",
    ]
    assert len(report["cases"]) == 1 + 3 + 4 and report["ok"] is True


def test_a_run_nobody_recorded_is_not_found(saga_env: dict[str, str]) -> None:
    deployment = {k: saga_env[k] for k in ("SAGA_REDIS_URL", "SAGA_DATABASE_URL")}
    done = saga_drill(ROOT, "--app", "tasks.app:saga", "--from-run", "no-such-run", **deployment)
    assert done.returncode == 3 and "no run no-such-run" in done.stderr


def test_an_unknown_fault_kind_is_a_usage_error() -> None:
    done = saga_drill(ROOT, "--app", "tasks.app:saga", "--scenario", "x:y", "--fault", "typo")
    assert done.returncode == 2 and "unknown --fault typo" in done.stderr


def test_the_example_drills_itself_with_the_plugin_fixture() -> None:
    done = pytest_in(EXAMPLE, "-rA")
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert "1 passed, 1 xfailed" in done.stdout


HOSTED = ["--app", "tests.integration.drill_agents:saga", "--input", "Refund order 4921."]
HOSTED += [
    "--model-script",
    "tests.integration.drill_agents:SCRIPT",
    "--setup",
    "tasks.systems:reset",
]


def test_a_hosted_agent_with_an_approval_passes_its_model_answering_differently(
    tmp_path: Path,
) -> None:
    # When the agent is drilled, its model answering each turn differently when asked again
    # (the reply, which waits for a person, given as a variant), and its run aborted after
    # each step and a write delivered twice
    args = [
        *HOSTED,
        "--agent",
        "approving",
        "--variants",
        "tests.integration.drill_agents:VARIANTS",
    ]
    for kind in ("model_differs_on_replay", "aborted_after", "delivered_twice"):
        args += ["--fault", kind]
    done = saga_drill(
        ROOT, *args, "--json", str(tmp_path / "drill.json"), SAGA_DEMO_DATA=str(tmp_path / "data")
    )

    # Then every case agrees with the world, and each turn's replayed ask was the one acted on
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-3000:]
    report = json.loads((tmp_path / "drill.json").read_text())
    assert [s["tool"] for s in report["steps"]] == ["get_order", "issue_credit", "send_reply"]
    cases = {c["fault"]["name"]: c for c in report["cases"]}
    replayed = [n for n in cases if n.startswith("model_differs_on_replay")]
    assert replayed == [f"model_differs_on_replay @ turn {t} (approving)" for t in (1, 2, 3)]
    assert all(
        cases[n]["end_state"] == "completed" and cases[n]["fault_hits"] >= 1 for n in replayed
    )
    assert len(cases) == 1 + 3 + 3 + 2 and report["ok"] is True and report["notes"] == []


def test_a_model_gateway_that_answers_a_replayed_turn_from_its_cache_is_caught(
    tmp_path: Path,
) -> None:
    # When the agent behind a caching gateway is drilled on one turn asked again
    args = [*HOSTED, "--agent", "cached", "--fault", "model_differs_on_replay"]
    done = saga_drill(
        ROOT, *args, "--max-cases", "1", "--seed", "1", SAGA_DEMO_DATA=str(tmp_path / "data")
    )

    # Then the drill says the model was never asked again: the case tested nothing
    assert done.returncode == 1, done.stdout[-4000:] + done.stderr[-3000:]
    assert "was not asked again after its answer was lost" in done.stdout
    assert "  MISMATCH model_differs_on_replay @ turn " in done.stdout


def test_an_agent_the_app_does_not_host_is_a_usage_error(tmp_path: Path) -> None:
    done = saga_drill(ROOT, *HOSTED, "--agent", "nobody", SAGA_DEMO_DATA=str(tmp_path / "data"))
    assert done.returncode == 2, done.stdout[-4000:] + done.stderr[-3000:]
    assert "--agent 'nobody': the app hosts no such agent" in done.stderr
