"""The stateful model checks (``tests.reliability.modelcheck``, the engine's, and
``tests.reliability.modelcheck_hosted``, the hosted loop's), bounded for the test suite.

A fixed number of derandomized examples (the same ones on every run, so a failure here is a
regression, not bad luck) against a private ``redis-server`` this test starts and stops; no
Celery worker. Any violation fails the test with Hypothesis's shrunk program of rules.
"""

from __future__ import annotations

import shutil
from typing import Any

import pytest

from tests.conftest import service_missing

#: 150 examples of at most 35 rules take about 20 s on two cores when nothing fails (a
#: failure adds its shrinking: typically under a minute).
EXAMPLES = 150
STEPS = 35


def redis_server_installed() -> None:
    if shutil.which("redis-server") is None:
        service_missing("redis-server is not installed (Debian: apt-get install redis-server)")


def check(machine: Any, engine: Any, examples: int, steps: int) -> None:
    """Run the state machine ``machine`` on ``engine``'s private Redis, derandomized."""
    from hypothesis.stateful import run_state_machine_as_test

    from tests.reliability import modelcheck

    settings = modelcheck.profile(examples, steps, derandomize=True)
    with modelcheck.quiet_logs(), modelcheck.running(engine):
        run_state_machine_as_test(machine, settings=settings)


@pytest.mark.timeout(300)
def test_model_check_finds_no_violation() -> None:
    redis_server_installed()
    from tests.reliability import modelcheck

    check(modelcheck.ModelCheck, None, EXAMPLES, STEPS)


#: The hosted loop's check: 120 examples of at most 30 rules, about 20 s on two cores.
HOSTED_EXAMPLES = 120
HOSTED_STEPS = 30


@pytest.mark.timeout(300)
def test_hosted_model_check_finds_no_violation() -> None:
    redis_server_installed()
    from tests.reliability import modelcheck_hosted

    check(
        modelcheck_hosted.HostedCheck, modelcheck_hosted.HostedEngine, HOSTED_EXAMPLES, HOSTED_STEPS
    )


#: The shrunk programs with which the hosted check finds issue 15's defects 1, 3 and 7 on the
#: code before their fixes (commit 260c8c9): each must now replay without a violation.
OLD_DEFECTS: dict[str, list[tuple[str, dict[str, object]]]] = {
    "final answer recorded, crash before complete, the reaper unwinds": [
        ("start_runs", {"count": 1, "undo_failures": 0, "script": []}),
        ("arm_turn_crash", {"point": "after_loop_ended"}),
    ],
    "a model call outlasts its lease, a repeated enqueue asks again": [
        ("start_runs", {"count": 1, "undo_failures": 0, "script": []}),
        ("start_delivery", {"pick": 0}),
        ("lease_time_passes", {}),
        ("enqueue_again", {"run": 0, "via": "saga"}),
        ("start_delivery", {"pick": 0}),
    ],
    "the fourth unanswered approval abandons the run": [
        ("start_runs", {"count": 1, "undo_failures": 0, "script": ["mail"] * 4}),
    ],
}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("defect", list(OLD_DEFECTS))
def test_hosted_model_check_replays_the_old_defects_without_a_violation(defect: str) -> None:
    redis_server_installed()
    from tests.reliability import modelcheck, modelcheck_hosted

    program = modelcheck.Program(OLD_DEFECTS[defect], modelcheck_hosted.HostedCheck)
    with modelcheck.quiet_logs(), modelcheck.running(modelcheck_hosted.HostedEngine):
        violation, transcript = program.replay()
    assert violation is None, "\n".join(transcript)


#: The shrunk programs with which the engine check finds two defects of the reversal policy
#: (before the fixes in ``saga.unwind.unwind_chain`` and ``saga.core.Core.record_end``): each
#: must now replay without a violation.
ENGINE_OLD_DEFECTS: dict[str, list[tuple[str, dict[str, object]]]] = {
    # undo-below-asked: the reaper read the run, its undo asked a person, the reaper took the
    # unwind over and its chain skipped the question: the older undo ran before any answer.
    "a reaper's stale take-over runs the undos below a question": [
        ("start_runs", {"count": 1, "undo_failures": 0}),
        ("dispatch", {"run": 0, "tool": "hold_stock"}),
        ("settle", {}),
        ("dispatch", {"run": 0, "tool": "book_courier"}),
        ("settle", {}),
        ("end_run", {"run": 0, "how": "abort"}),
        ("reap_paused", {"run": 0, "clock": "past_deadline"}),
        ("start_delivery", {"pick": 0}),
        ("finish_delivery", {"pick": 0, "outcome": "proceed", "ack_lost": False}),
        ("resume_reaper", {}),
        ("settle", {}),
    ],
    # kept-not-resolved: the worker that concluded a kept run died before it resolved the
    # escalation; the redelivered conclusion recorded it open.
    "a kept run's conclusion dies before its resolution": [
        ("start_runs", {"count": 1, "undo_failures": 0}),
        ("dispatch", {"run": 0, "tool": "book_courier"}),
        ("settle", {}),
        ("end_run", {"run": 0, "how": "abort"}),
        ("settle", {}),
        ("answer", {"pick": 0, "decision": "keep", "shown": "right", "reply": "ok"}),
        ("fault", {"kind": "crash_after_conclusion"}),
        ("settle", {}),
    ],
    # concurrent-undo-distinct-tasks: an undo revoked (terminate) while it ran keeps its lease;
    # a requeue's message revoked in the queue failed it again and ended that lease, so the
    # next requeue's attempt ran the undo beside the first execution.
    "a queued revoke ends the lease of an undo still running": [
        ("start_runs", {"count": 2, "undo_failures": 0}),
        ("dispatch", {"run": 0, "tool": "issue_credit"}),
        ("settle", {}),
        ("dispatch", {"run": 0, "tool": "issue_credit"}),
        ("broker", {"action": "revoke", "pick": 0}),
        ("start_delivery", {"pick": 1}),
        ("revoke_terminate", {"pick": 0}),
        ("settle", {}),
        ("requeue", {"fix": False, "run": 0}),
        ("broker", {"action": "revoke", "pick": 0}),
        ("settle", {}),
        ("requeue", {"fix": False, "run": 0}),
        ("settle", {}),
    ],
}


#: A false alarm the engine check raised (before ``time-limit-kill`` counted among the faults
#: that may rightly spoil a requeue): a requeued undo killed twice by the hard time limit used
#: up its attempts and escalated, as it should; the check expected it to compensate.
ENGINE_FALSE_ALARMS: dict[str, list[tuple[str, dict[str, object]]]] = {
    "a requeued undo killed twice by the time limit escalates": [
        ("start_runs", {"count": 2, "undo_failures": 2}),
        ("dispatch_publish_fails", {"run": 1, "send": "before", "tool": "issue_credit"}),
        ("settle", {}),
        ("end_run", {"how": "abort", "run": 0}),
        ("end_run", {"how": "abort", "run": 0}),
        ("settle", {}),
        ("requeue", {"fix": False, "run": 0}),
        ("start_delivery", {"pick": 0}),
        ("reap_paused", {"clock": "past_time_limit", "run": 0}),
        ("reaper_races_delivery", {"clock": "past_deadline", "pick": 0}),
        ("reap_paused", {"clock": "past_time_limit", "run": 0}),
    ],
}


#: Every engine program above: each must replay without a violation.
ENGINE_REPLAYS = {**ENGINE_OLD_DEFECTS, **ENGINE_FALSE_ALARMS}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("program", list(ENGINE_REPLAYS))
def test_model_check_replays_old_defects_and_false_alarms_without_a_violation(
    program: str,
) -> None:
    redis_server_installed()
    from tests.reliability import modelcheck

    replay = modelcheck.Program(ENGINE_REPLAYS[program])
    with modelcheck.quiet_logs(), modelcheck.running():
        violation, transcript = replay.replay()
    assert violation is None, "\n".join(transcript)


@pytest.mark.timeout(120)
def test_model_check_sends_a_step_the_broker_lost_again() -> None:
    """The broker loses a queued step (a Redis without persistence, restarted): the reaper
    sends it again at the deadline, and the run goes on to complete with its effect once."""
    redis_server_installed()
    from tests.reliability import modelcheck

    program = modelcheck.Program(
        [
            ("start_runs", {"count": 1, "undo_failures": 0}),
            ("dispatch", {"run": 0, "tool": "issue_credit"}),
            ("broker", {"action": "lose", "pick": 0}),
            ("reap", {"clock": "past_deadline"}),
            ("settle", {}),
            ("end_run", {"run": 0, "how": "complete"}),
        ]
    )
    with modelcheck.quiet_logs(), modelcheck.running():
        violation, transcript = program.replay()
    story = "\n".join(transcript)
    assert violation is None, story
    assert "lost by the broker" in story and "reaper-resent" in story, story
    assert "completed" in story, story
