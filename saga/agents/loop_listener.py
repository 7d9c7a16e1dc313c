"""What moves a hosted run on from outside its turns: a step of a turn settling, and the
reaper finding the run idle past its deadline.

Its own module because these are the run's listener (``saga.hooks.RunListener``), called by
the core and the reaper, never by a turn: the turn (``saga.agents.hosted``) plays itself and
sends the next one when it can; this sends it when a tool task or the reaper is the one that
sees the turn done, or the turn lost.
"""

from __future__ import annotations

import logging

from saga.agents import approvals
from saga.agents.hosted import carry_out_end, end_of, turn_store
from saga.agents.launch import send_turn
from saga.agents.turn_state import LoopState
from saga.core import Core
from saga.hooks import RunListener
from saga.model import RunState

logger = logging.getLogger("saga.agents")

#: How often the reaper may send a stalled turn again before it aborts the run as abandoned.
MAX_REVIVALS = 3


class HostedLoop(RunListener):
    """Moves hosted runs on when their steps settle, and revives a stalled one."""

    def __init__(self, core: Core) -> None:
        self.core = core

    def step_settled(self, run_id: str, step: int, turn_done: int | None = None) -> None:
        """The step of a turn's call settled: if it was the turn's last, send the next turn.
        A success's own script has already checked (``turn_done``); any other outcome is
        checked here, in one script, whichever step it was."""
        turn = self.core.store.advance_turn(run_id, step=step) if turn_done is None else turn_done
        if turn:
            send_turn(self.core.app, run_id, turn + 1)

    def run_idle(self, run_id: str) -> bool:
        """The reaper found the run idle past its deadline: move it on if the loop can.
        Carries out a recorded end; expires the approvals it waits for (and moves on, no
        revival spent); else sends the current turn again (or, if it is done, the next):
        its message or the notice of its last step was lost. Gives up after ``MAX_REVIVALS``
        revivals of one stall (progress in between starts the count afresh)."""
        picture = self.core.store.picture(run_id)
        state = LoopState.parse(picture.agent) if picture is not None else None
        if picture is None or state is None or picture.state is not RunState.RUNNING:
            return False
        if state.ended:
            carry_out_end(self.core, run_id, state.end or end_of(state.ended), state.ended)
            return True
        expired, waiting = approvals.expire_waiting(self.core.store, run_id, state)
        if expired:
            logger.info("run %s: %d approval(s) expired; the turn goes on", run_id, expired)
            self._send_again(run_id, state.current_turn)
            return True
        if waiting:
            return True  # a person has until the request expires; the reaper looks again
        if turn_store(self.core).count_revival(run_id) > MAX_REVIVALS:
            return False
        turn = state.current_turn
        logger.warning("run %s: idle at turn %d; sending it again", run_id, turn)
        self._send_again(run_id, turn)  # it resumes, then moves the run on itself
        return True

    def _send_again(self, run_id: str, turn: int) -> None:
        """Send the turn again for the reaper. A broker that refuses it is no reason to abandon
        the run (its unwind would need the same broker): the run stays the loop's, and the
        reaper's next look, a deadline later, sends it again (a revival spent each time)."""
        try:
            send_turn(self.core.app, run_id, turn)
        except Exception as exc:
            logger.error("run %s: the broker did not take turn %d (%r); later", run_id, turn, exc)
