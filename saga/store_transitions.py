"""A run's moves through its state machines (``saga.machine``), one script each: reserving and
recording steps, the doubt and its resolution, the unwind and its compensations, the end, and
what a person does to an escalated run (requeue, resolve) or to an ended one (restore).

Each method is where its script's arguments are put in order and its answer read, so the
store's callers name a transition, never a script and the position of its arguments.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from saga import payload
from saga.constants import LOOK_AFTER_EXPIRY, ended_key, settled_key
from saga.model import RunState, ToolClass
from saga.picture import RunPicture, hashes_of
from saga.rules import CallGate
from saga.store_reads import picture_of, read_picture
from saga.store_scripts import Outcome, StoreCore, outcome_of, queue_script

#: A revoke's claim saying the running execution was killed (SIGKILL): its lease ends with it.
REVOKE_KILLED = "killed"


@dataclass(frozen=True)
class StepPush:
    """A step's message, for the reservation to push to ``queue`` (a list on the store's
    Redis) in the same script, if the step it reserves is ``step``."""

    queue: str
    step: int
    message: str


@dataclass(frozen=True)
class ChainPush:
    """An unwind's first message (carrying the rest of its chain), for ``mark_sent`` to push
    to ``queue`` with the mark; ``chain``: that message's task id, by which a repeat of the
    same call (a command retried on a lost connection) pushes nothing more."""

    queue: str
    chain: str
    message: str


class Conclusion(NamedTuple):
    """A run's end judged beforehand, for the script that records its last undo to make
    (``RunTransitions.record_done_and_conclude``): only on the run at ``version``."""

    state: RunState
    reason: str
    owner: str
    version: str


class RunTransitions(StoreCore):
    """The store's transitions of a run and its steps and compensations."""

    def reserve(
        self,
        run_id: str,
        tool: str,
        tool_class: ToolClass,
        args_json: str,
        gate: CallGate,
        marker: str = "",
        on_failure: str = "",
        push: StepPush | None = None,
    ) -> Outcome:
        """Reserve the next step if ``gate`` holds right now: ``ok`` with the step number,
        or ``refused`` / ``ended`` / ``unknown``, having changed nothing; ``dup`` with the
        step a call with this ``marker`` got before. ``on_failure="feed_back"``: a final
        failure of the step is recorded as ``rejected`` and the run goes on. ``push``: the
        step's message, pushed in the same script if the step reserved is the one it was
        made for (``ok``, the step, ``sent``)."""
        unsettled = ",".join(str(int(c)) for c in sorted(gate.unsettled_classes))
        before_pivot = int(gate.before_pivot)
        args: list[Any] = [
            tool,
            int(tool_class),
            args_json,
            unsettled,
            before_pivot,
            marker,
            on_failure,
        ]
        if push is None:
            return self._call("reserve", run_id, *args)
        args += [push.step, push.message]
        return self._call("reserve", run_id, *args, extra=push.queue)

    def release(self, run_id: str, step: int, error: dict[str, Any]) -> Outcome:
        """The broker refused the step's message: ``ok`` (released), or ``started`` with the
        state a delivery already moved it to (the message got through after all)."""
        return self._call("release", run_id, step, _error_json(error), step=step)

    def count_resend(
        self, run_id: str, step: int, most: int, *, take_back: bool = False
    ) -> Outcome:
        """The reaper sends a step's message again (no delivery began it): ``sent`` with how many
        times now, ``spent`` once it was sent ``most`` times, ``state`` if it is no longer
        ``dispatched`` (a delivery began it meanwhile: nothing to send). ``take_back``: the
        send failed (the broker away), so it does not count."""
        return self._call("count_resend", run_id, step, most, -1 if take_back else 1)

    def begin_step(
        self, run_id: str, step: int, tool: str, args_json: str, claim: str, lease: float
    ) -> Outcome:
        return self._call("begin_step", run_id, step, tool, args_json, claim, lease, step=step)

    def record_success(
        self,
        run_id: str,
        step: int,
        result_json: str,
        entry_json: str,
        irreversible: bool,
        problem: dict[str, Any] | None = None,
        fails: str = "",
    ) -> Outcome:
        """``problem``: what went wrong recording the effect, kept as the step's error;
        ``fails``: the reason a running run fails with it ('' leaves the run running)."""
        return self._call(
            "record_success",
            run_id,
            step,
            result_json,
            entry_json,
            int(irreversible),
            "" if problem is None else _error_json(problem),
            fails,
            step=step,
        )

    def record_failure(
        self, run_id: str, step: int, error: dict[str, Any], event: str = "fail"
    ) -> Outcome:
        """``event``: ``fail`` (the worker, after the retries), ``reject`` (nothing happened and
        the run goes on) or ``never_started`` (the reaper's verdict, refused for a step a
        delivery began)."""
        return self._call("record_failure", run_id, step, _error_json(error), event, step=step)

    def record_final_failure(
        self, run_id: str, step: int, error: dict[str, Any]
    ) -> tuple[Outcome, RunPicture | None]:
        """``record_failure`` (``fail``), and the run read back in the same transaction: the
        picture the unwind's owner starts from (``Core.start_unwind``), without a round trip
        of its own between the failure and the unwind's chain."""
        args = (step, _error_json(error), "fail")
        return self._call_and_read("record_failure", run_id, args, [settled_key(run_id, step)])

    def record_failure_and_push(
        self, run_id: str, step: int, error: dict[str, Any], version: str, push: ChainPush
    ) -> Outcome:
        """``record_failure`` (``fail``) and, if it makes the step the unwind's owner while the
        run is still at ``version`` (the reading ``push``'s chain was made from), the chain
        pushed and marked sent by the same script, as ``mark_sent`` would: one wait for the
        disk instead of two. ``pushed`` tells whether it was; an owner it was not pushed for
        starts its unwind as any owner does."""
        args = (step, _error_json(error), "fail", version, push.chain, push.message)
        return self._call("record_failure", run_id, *args, step=step, extra=push.queue)

    def record_retry(self, run_id: str, step: int, error: dict[str, Any], hold: float) -> Outcome:
        return self._call("record_retry", run_id, step, _error_json(error), hold)

    def mark_in_doubt(
        self,
        run_id: str,
        step: int,
        error: dict[str, Any],
        event: str = "doubt",
        respect_lease: bool = False,
    ) -> Outcome:
        return self._call(
            "mark_in_doubt", run_id, step, _error_json(error), event, int(respect_lease), step=step
        )

    def resolve_in_doubt(
        self,
        run_id: str,
        step: int,
        verdict: str,
        result_json: str,
        entry_json: str,
        irreversible: bool,
        doubt: str,
    ) -> Outcome:
        return self._call(
            "resolve_in_doubt",
            run_id,
            step,
            verdict,
            result_json,
            entry_json,
            int(irreversible),
            doubt,
            step=step,
        )

    def take_over(self, run_id: str, version: str, owner: str) -> bool:
        return self._call("take_over", run_id, version, owner).status == "ok"

    def abort(self, run_id: str, reason: str, version: str = "") -> Outcome:
        """``version``: abort only if the run is still at it (``moved`` otherwise).
        ``repeat``: this very abort (the same reason) was applied already, however far its
        unwind got; it owns the unwind again only if that one was never sent."""
        return self._call("abort", run_id, reason, version)

    def mark_sent(self, run_id: str, owner: str, push: ChainPush | None = None) -> bool:
        """``owner``'s unwind is on the broker: False if ``owner`` no longer owns it. With
        ``push``, its chain is pushed by this same script, only while ``owner`` owns it: the
        chain exists exactly when it is marked sent."""
        if push is None:
            return self._call("mark_sent", run_id, owner).status == "1"
        args = (owner, push.chain, push.message)
        return self._call("mark_sent", run_id, *args, extra=push.queue).status == "1"

    def mark_refused(self, run_id: str, owner: str) -> bool:
        """The broker refused the unwind of ``owner`` (still the owner, nothing sent)."""
        return self._call("mark_refused", run_id, owner).status == "1"

    def begin_compensation(
        self,
        run_id: str,
        step: int,
        claim: str,
        task_id: str,
        unwind: str,
        lease: float,
        ask_seconds: float = 86400.0,
    ) -> Outcome:
        """``run`` (attempt, entry); ``ask`` (until when, the entry's hash) when its tool's
        reversal policy asks a person first; ``asked`` while one is asked; ``done``,
        ``failed``, ``kept`` (settled: pass the chain on); ``busy``, ``stale``, ``ended``."""
        args = (step, claim, task_id, unwind, lease, ask_seconds)
        return self._call("begin_compensation", run_id, *args)

    def decide_reversal(
        self,
        run_id: str,
        step: int,
        decision: str,
        args_hash: str,
        by: str,
        note: str,
        owner: str,
        later_seconds: float = 86400.0,
    ) -> Outcome:
        """A person's answer about reversing step ``step``'s effect (``reverse``, ``keep``,
        ``later``), or the reaper's ``expire``: ``ok`` (with the new owner of the unwind, for
        all but ``later``), ``decided`` (answered already: the state and that decision),
        ``mismatch`` (another undo's hash), ``waiting`` (not expired yet), ``ended``,
        ``unknown``."""
        args = (step, decision, args_hash, by, note, owner, later_seconds)
        return self._call("decide_reversal", run_id, *args)

    def record_compensation(
        self,
        run_id: str,
        step: int,
        outcome: str,
        error: dict[str, Any] | None = None,
        claim: str = "",
        owner: str = "",
        push: tuple[str, str] | None = None,
    ) -> Outcome:
        """``outcome``: ``done``, ``fail``, ``retry`` (by the claim's holder) or ``revoke`` (for
        the unwind of ``owner``; ``claim=REVOKE_KILLED`` when the execution died by SIGKILL).
        ``push``: a queue and a message (the next undo's) pushed by the same script if, and
        only if, it records the undo done (``ok``)."""
        args = (step, outcome, _error_json(error), claim, owner)
        if push is None:
            return self._call("record_compensation", run_id, *args)
        return self._call("record_compensation", run_id, *args, push[1], extra=push[0])

    def record_last_compensation(
        self, run_id: str, step: int, outcome: str, error: dict[str, Any] | None, claim: str
    ) -> tuple[Outcome, RunPicture | None]:
        """``record_compensation`` of the unwind's last undo (``done`` or ``fail``), and the
        run read back in the same transaction: the picture its conclusion is judged on
        (``Core.conclude``), without a round trip of its own."""
        args = (step, outcome, _error_json(error), claim, "")
        return self._call_and_read("record_compensation", run_id, args)

    def record_done_and_conclude(
        self, run_id: str, step: int, claim: str, conclusion: Conclusion
    ) -> Outcome:
        """``record_compensation`` of the unwind's last undo, done, and its ``conclusion``
        (judged beforehand) made by the same script if the record leaves the run at the
        version it was judged for and took the undo's entry off the stack: one wait for the
        disk instead of two. The outcome's values then hold what the conclusion answered
        (``ok`` and what it wrote, or why it did not conclude); none if it was not tried."""
        state, reason, owner, version = conclusion
        args = (step, "done", "", claim, "", "", state.value, reason, owner, version)
        return self._call("record_compensation", run_id, *args)

    def conclude(
        self, run_id: str, state: RunState, reason: str = "", owner: str = "", version: str = ""
    ) -> Outcome:
        """``version``: conclude only if the run is still at it (``moved`` otherwise)."""
        return self._call("conclude", run_id, state.value, reason, owner, version)

    def _mark_recorded(self, run_id: str, version: str, notify: bool, index: str) -> bool:
        """``RunStore.mark_recorded``'s script. ``index``: the run's shard of the reaper's
        index on the same server (not a cluster), where the script moves the run's entry to
        when the keys will have expired; ``""``: the caller does."""
        args: tuple[Any, ...] = (version, self.retention_seconds, int(notify))
        keys = [ended_key(run_id)]
        if index:
            keys.append(index)
            args += (run_id, self.retention_seconds + LOOK_AFTER_EXPIRY)
        return self._call("mark_recorded", run_id, *args, extra=keys).status == "ok"

    def requeue(
        self,
        run_id: str,
        corrections: Mapping[int, str] | None = None,
        version: str = "",
        action: str = "{}",
    ) -> Outcome:
        """Reopen an escalated run's failed compensations: ``ok`` with the new owner and how
        many; ``refused`` / ``unknown`` / ``resolved`` (a person closed it) having changed
        nothing. ``corrections``: step -> its corrected undo entry (JSON), applied only if the
        run is still at ``version`` (``moved`` otherwise) and every one of them names a
        compensation the requeue runs again (``uncorrectable`` with the step otherwise).
        ``action`` (JSON: who, what they corrected) is kept with the run for its record."""
        encoded = json.dumps({str(n): e for n, e in (corrections or {}).items()})
        return self._call("requeue", run_id, encoded if corrections else "", version, action)

    def resolve(self, run_id: str, generation: int, resolution: str) -> Outcome:
        """Mark the run's escalation of ``generation`` resolved by a person (``resolution``:
        JSON). ``ok``; ``unknown`` (no keys); ``state`` (not escalated: a requeue runs, or it
        ended otherwise); ``stale`` (a later generation); ``resolved`` (already, with the
        resolution and when)."""
        return self._call("resolve", run_id, str(generation), resolution)

    def restore(self, picture: RunPicture) -> bool:
        """Rebuild an ended run's keys from ``picture`` (its SQL record), expiring after the
        retention period; False (nothing written) if any of its keys exist."""
        run, steps, stack, comps = hashes_of(picture)
        documents = (json.dumps(part, ensure_ascii=False) for part in (run, steps, stack, comps))
        outcome = self._call("restore", picture.run_id, *documents, self.retention_seconds)
        return outcome.status == "ok"

    def complete(self, run_id: str) -> tuple[Outcome, RunPicture | None]:
        """Conclude a running run as completed and read it back, in one transaction (one
        round trip): the outcome, and the picture as the conclusion left it."""
        return self._call_and_read("conclude", run_id, (RunState.COMPLETED.value, "", ""))

    def _call_and_read(
        self, script: str, run_id: str, args: Sequence[Any], extra: Sequence[str] = ()
    ) -> tuple[Outcome, RunPicture | None]:
        """``script`` and the whole run read in one transaction (one round trip): the
        outcome, and the picture as the script left it (None: no run). ``extra``: the keys
        after the run's, as ``_call`` takes them."""

        def queue(pipe: Any) -> None:
            queue_script(pipe, self._scripts[script].sha, run_id, args, extra)
            read_picture(pipe, run_id)

        raw, *read = self._pipelined(script, run_id, queue, transaction=True)
        return outcome_of(script, run_id, raw, args), picture_of(run_id, read)


def _error_json(error: dict[str, Any] | None) -> str:
    if error is None:
        return ""
    return payload.dumps(error, what="error", limit=1 << 20)
