"""The hosted agent loop's moves (``saga.agents``), one script each: a turn's lease on its
model call, the answer and the results the model reads (first writer wins, so a redelivered
turn replays), the approvals a person decides, and the deadline and revivals of the loop.

They are the store's like the run's own transitions, but only a hosted run makes them; kept
apart, a change to the loop does not touch the saga's core transitions.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from saga.constants import turn_lease_key
from saga.store_scripts import Outcome, StoreCore, reachable


@dataclass(frozen=True)
class AskerFence:
    """How a delivery fences the last asker of a turn whose lease ran out under it: it may
    ask once it has seen the store answer for ``seconds``, never ``gap_seconds`` without, and
    the asker give no sign of life meanwhile. Longer than the asker's keeper takes to renew
    once the store is back (``saga.agents.lease``), and than a replay's pause."""

    seconds: float
    gap_seconds: float

    def as_ms(self) -> tuple[int, int]:
        return max(1, int(self.seconds * 1000)), max(1, int(self.gap_seconds * 1000))


class TurnScripts(StoreCore):
    """The store's scripts of a hosted agent's turns and approvals."""

    if TYPE_CHECKING:  # the run indexes' (``RunStore`` has both)

        def schedule_sooner(self, run_id: str, at: float) -> None: ...

    def ask_model(
        self,
        run_id: str,
        turn: int,
        lease_seconds: float,
        token: str,
        most: int = 0,
        fence: AskerFence | None = None,
    ) -> str:
        """Take turn ``turn``'s lease under ``token`` and count the policy call it is taken
        for: ``ok``; else nothing counted: ``busy`` while another delivery holds the lease,
        ``fenced`` while the last asker's lease ran out under it and ``fence`` has not yet
        seen it give no sign of life (ask again within ``fence.gap_seconds``), ``answered``
        when the turn's answer is recorded, ``spent`` when the turn has been asked ``most``
        times already (0: no limit), ``ended`` when the run is no longer running (aborted,
        reaped, unwinding). ``fence`` None: no fence (a lease that ran out is free)."""
        lease_ms = max(1, int(lease_seconds * 1000))
        lease = turn_lease_key(run_id, turn)
        fence_ms, gap_ms = (0, 0) if fence is None else fence.as_ms()
        args = (turn, lease_ms, token, most, fence_ms, gap_ms)
        return str(self._call("ask_model", run_id, *args, extra=lease).status)

    def renew_turn_lease(self, run_id: str, turn: int, token: str, lease_seconds: float) -> str:
        """Extend the turn's lease if ``token`` still holds it: ``ok``; ``retaken`` when the
        lease had run out with nobody else holding it and the turn unanswered (the store was
        away longer than the lease); ``lost`` when another delivery holds it, or the turn is
        answered."""
        lease_ms = max(1, int(lease_seconds * 1000))
        lease = turn_lease_key(run_id, turn)
        outcome = self._call("turn_lease", run_id, "renew", token, lease_ms, turn, extra=lease)
        return str(outcome.status)

    def release_turn_lease(self, run_id: str, turn: int, token: str) -> None:
        """End the turn's lease if ``token`` still holds it (a model call with no answer),
        and with it the asker's fence: it gave its call up."""
        lease = turn_lease_key(run_id, turn)
        self._call("turn_lease", run_id, "release", token, 0, turn, extra=lease)

    def record_answer(
        self,
        run_id: str,
        turn: int,
        answer_json: str,
        calls: int,
        input_tokens: int,
        output_tokens: int,
        token: str = "",
    ) -> Outcome:
        """A hosted turn's model answer (making ``calls`` tool calls), first writer wins:
        ``ok`` or ``dup``, each with the answer as recorded; ``unknown`` for a run with no
        agent. Releases the turn's lease if ``token`` holds it."""
        lease = turn_lease_key(run_id, turn)
        args = (turn, answer_json, input_tokens, output_tokens, calls, token)
        return self._call("record_answer", run_id, *args, extra=lease)

    def advance_turn(self, run_id: str, turn: int = 0, step: int = 0) -> int:
        """Mark turn ``turn`` (or the turn whose call ``step`` made) done if every call of it
        is refused or settled and the run still runs: the turn, for the one caller that did
        (it sends the next turn); 0 for every other caller, and for a step of ``run.call``."""
        outcome = self._call("advance_turn", run_id, turn or "", step)
        return int(outcome.values[0]) if outcome.status == "ok" else 0

    def freeze_results(self, run_id: str, turn: int, results_json: str) -> str:
        """The results of turn ``turn`` the model reads, first writer wins: those recorded."""
        return str(self._call("freeze_results", run_id, turn, results_json).values[0])

    def decide_approval(
        self, run_id: str, marker: str, verdict: str, by: str, reason: str, args_hash: str
    ) -> Outcome:
        """A person's decision on a hosted call awaiting approval: ``ok``; ``repeat`` (this
        very decision, by the same person, was taken already); or ``unknown`` / ``decided`` /
        ``ended`` / ``mismatch`` (other arguments) / ``expired``."""
        return self._call("decide_approval", run_id, marker, verdict, by, reason, args_hash)

    def record_refusal(self, run_id: str, marker: str, message: str) -> bool:
        """Why the hosted call ``marker`` is not dispatched, first writer wins (True if this
        caller's reason is the one recorded)."""
        return self._call("record_refusal", run_id, marker, message).status == "ok"

    def request_approval(self, run_id: str, marker: str, request_json: str) -> bool:
        """Ask a person about the call ``marker`` (stamped with the Redis clock); first
        writer wins. Indexed first (the run's shard of the awaiting-approval index): a request
        the index missed would be listed nowhere but on its run."""
        with reachable("request_approval"):
            self.client.zadd(self.layout.awaiting_of(run_id), {run_id: self.now()}, nx=True)
        return self._call("request_approval", run_id, marker, request_json).status == "ok"

    def expire_approval(self, run_id: str, marker: str, message: str) -> Outcome:
        """Judge a waiting approval: ``decided`` (with the decision), ``expired`` (refused
        with ``message``, now or before), ``waiting`` (with when it expires), ``unknown``."""
        return self._call("expire_approval", run_id, marker, message)

    def adopt_deadline(self, run_id: str, deadline: float) -> bool:
        """Give a run created with ``deadline_open`` its agent's deadline (once; False when it
        had been given already), and bring the reaper's look forward if it is now sooner."""
        outcome = self._call("adopt_deadline", run_id, deadline)
        if outcome.status != "ok":
            return False
        self.schedule_sooner(run_id, float(outcome.values[0]) + deadline)
        return True

    def count_revival(self, run_id: str) -> int:
        """The reaper sends a stalled hosted turn again: how often for this stall."""
        return int(self._call("count_revival", run_id).values[0])
