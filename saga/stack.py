"""The compensation stack and run state, in Redis.

This is workflow state: it must outlive any worker, so it lives in Redis and every change that
touches more than one key is a single Lua script (``saga/lua``). Steps follow the durable-step
rule: check the recorded outcome before running, record the outcome after, so a redelivered
message replays instead of re-executing.
"""

from __future__ import annotations

import functools
import json
import logging
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from importlib import resources
from typing import TYPE_CHECKING, Any, cast

import redis
from redis.commands.core import Script
from redis.exceptions import NoScriptError

from saga import payload
from saga.constants import (
    ACTIVE_RUNS_KEY,
    AWAITING_APPROVAL_KEY,
    CREATED_RUNS_KEY,
    REAPER_PASS_KEY,
    agent_key,
    ended_key,
    run_keys,
    script_keys,
    settled_key,
    turn_lease_key,
)
from saga.errors import ConfigurationError, StoreUnavailableError
from saga.machine import lua_tables
from saga.model import RunState, ToolClass
from saga.picture import (
    CompensationRecord,
    RunPicture,
    RunView,
    StepRecord,
    hashes_of,
    picture_from,
)

if TYPE_CHECKING:
    from saga.rules import CallGate

__all__ = [
    "CompensationRecord",
    "Outcome",
    "RunHead",
    "RunPicture",
    "RunStore",
    "RunView",
    "StepRecord",
]

logger = logging.getLogger("saga.stack")

#: Seconds between two measurements of this host's clock against the Redis server's.
_CLOCK_RESYNC = 60.0

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
    "adopt_deadline",
)

#: Answers of the scripts that mean "this transition is not in the table" (saga/machine.py).
ILLEGAL = "illegal"


@functools.cache
def script_sources() -> dict[str, str]:
    """Each script's whole text (the machine's tables and the prelude before it): what both
    the store and the asyncio client (``saga.aio``) register, so they run the same SHA."""
    folder = resources.files("saga") / "lua"
    prelude = lua_tables() + "\n" + (folder / "_prelude.lua").read_text()
    return {name: prelude + "\n" + (folder / f"{name}.lua").read_text() for name in _SCRIPTS}


def _load_scripts(client: redis.Redis) -> dict[str, Script]:
    return {name: client.register_script(text) for name, text in script_sources().items()}


@dataclass(frozen=True)
class Outcome:
    """What a script answered: a status word and whatever came with it."""

    status: str
    values: tuple[Any, ...] = ()

    @property
    def owns_unwind(self) -> bool:
        """True when this caller came to own the run's unwind (it must start it)."""
        return (
            self.status in ("ok", "dup", "skip", "failed", "late", "repeat")
            and bool(self.values)
            and self.values[0] in (1, "1")
        )


@dataclass(frozen=True)
class RunHead:
    """The few fields the reaper reads to decide whether a run needs a closer look."""

    state: RunState
    updated: float
    deadline: float
    recorded: bool
    ended: float | None


#: A revoke's claim saying the running execution was killed (SIGKILL): its lease ends with it.
REVOKE_KILLED = "killed"

#: Seconds a settle signal nobody took stays (as the scripts' ``notify`` sets it).
_SIGNAL_EXPIRY = 300

#: Connections per process at most, and how long a call waits for a free one (then the store
#: is unavailable, as if Redis were away).
_MAX_CONNECTIONS = 512
_POOL_WAIT = 30.0


class RunStore:
    """Reads and changes one Redis's runs; safe to share between threads.

    Every time the scripts record comes from the Redis server's clock (``TIME``), so hosts with
    drifting clocks agree on leases and deadlines; ``now()`` reads the same clock.
    """

    def __init__(self, client: redis.Redis, retention_seconds: int) -> None:
        self.client = client
        self.retention_seconds = retention_seconds
        self._scripts = _load_scripts(client)
        self._offset = 0.0
        self._offset_measured = float("-inf")

    @classmethod
    def from_url(cls, url: str, retention_seconds: int, **options: Any) -> RunStore:
        """A store on ``url`` whose connection pool waits for a free connection instead of
        raising (redis-py caps a plain pool at 100, and a web app with more threads waiting
        on results would see its calls fail). ``?max_connections=N`` in the URL sets the cap."""
        options = {"max_connections": _MAX_CONNECTIONS, "timeout": _POOL_WAIT, **options}
        pool = redis.BlockingConnectionPool.from_url(url, decode_responses=True, **options)
        return cls(redis.Redis.from_pool(pool), retention_seconds)

    def _call(
        self, script: str, run_id: str, *args: Any, step: int | None = None, extra: str = ""
    ) -> Outcome:
        keys = script_keys(run_id)
        if step is not None:
            keys.append(settled_key(run_id, step))
        elif extra:
            keys.append(extra)
        with reachable(script):
            raw = self._scripts[script](keys=keys, args=list(args))
        return outcome_of(script, run_id, raw, args)

    def now(self, exact: bool = False) -> float:
        """The Redis server's clock, the one every script records: this host's clock corrected
        by an offset measured with ``TIME`` once a minute (no round trip on each call), or,
        ``exact``, read right now (what judging a run idle needs: a host clock that jumped
        must not make every run look abandoned)."""
        host = time.time()
        if exact or host - self._offset_measured > _CLOCK_RESYNC:
            with reachable("time"):
                seconds, micros = self.client.time()
            self._offset = float(seconds) + micros / 1_000_000 - time.time()
            self._offset_measured = host
        return time.time() + self._offset

    # -- the reaper's index -----------------------------------------------------------------

    def create(
        self,
        run_id: str,
        deadline: float,
        allow_after_pivot: bool = False,
        agent: str = "",
        input_json: str = "",
        deadline_open: bool = False,
    ) -> bool:
        """Create the run (and, for a hosted ``agent``, its loop's hash with the input).
        ``deadline_open``: the deadline is a default the agent's own replaces
        (``adopt_deadline``).

        One round trip: the reaper's index (due at the deadline), the listing's index (by
        creation time, only if the run is new to it), then the script, which stamps the run
        with that same creation time, so a listing's cursor and the SQL record agree to the
        microsecond. Indexed first: a crash in between leaves index entries without keys,
        which the reaper and the listing skip and drop (never a run without them). The indexes
        are written here, not in the script, so every script touches one run's keys only (one
        hash tag: Redis Cluster)."""
        created = f"{self.now():.6f}"
        args = (int(allow_after_pivot), deadline, agent, input_json, created, int(deadline_open))
        sha = self._scripts["create"].sha
        *_, made = self._pipelined(
            "create", lambda pipe: queue_create(pipe, sha, run_id, args), transaction=False
        )
        return str(made) == "1"

    def _queue_script(self, pipe: Any, name: str, run_id: str, args: Sequence[Any]) -> None:
        queue_script(pipe, self._scripts[name].sha, run_id, args)

    def _pipelined(
        self, name: str, queue: Callable[[Any], None], *, transaction: bool
    ) -> list[Any]:
        """Run the commands ``queue`` puts on a pipeline (script ``name`` among them) in one
        round trip; once more after loading the script if Redis did not have it (it
        restarted): every command queued must be safe to repeat."""
        with reachable(name):
            for attempt in (1, 2):
                with self.client.pipeline(transaction=transaction) as pipe:
                    queue(pipe)
                    answers: list[Any] = pipe.execute(raise_on_error=False)
                if attempt == 1 and script_missing(answers):
                    self.client.script_load(self._scripts[name].script)
                    continue
                break
            raise_first_error(answers)
        return answers

    def schedule(self, run_id: str, at: float) -> None:
        """Have the reaper look at the run at ``at`` (Redis clock)."""
        with reachable("schedule"):
            self.client.zadd(ACTIVE_RUNS_KEY, {run_id: at})

    def due_runs(self, now: float, limit: int = 1000) -> list[tuple[str, float]]:
        """Runs the reaper should look at by ``now``, with when they were due."""
        with reachable("due_runs"):
            due = self.client.zrangebyscore(
                ACTIVE_RUNS_KEY, "-inf", now, start=0, num=limit, withscores=True
            )
        return [(str(run_id), float(score)) for run_id, score in cast(list[Any], due)]

    def active_runs(self) -> list[str]:
        """Every run the reaper keeps an eye on (running, unwinding, or kept for retention)."""
        with reachable("active_runs"):
            return cast(list[str], self.client.zrange(ACTIVE_RUNS_KEY, 0, -1))

    def note_reaper_pass(self) -> None:
        """The scheduled reaper finished a pass: what tells an operator beat is alive."""
        with reachable("note_reaper_pass"):
            self.client.set(REAPER_PASS_KEY, f"{self.now():.6f}")

    def last_reaper_pass(self) -> float | None:
        """When the scheduled reaper last finished a pass (Redis clock); None if never."""
        with reachable("last_reaper_pass"):
            value = self.client.get(REAPER_PASS_KEY)
        return float(value) if value else None

    def forget(self, run_id: str) -> None:
        """Drop a run whose keys are gone from the reaper's index and the listing's."""
        with reachable("forget"), self.client.pipeline(transaction=True) as pipe:
            pipe.zrem(ACTIVE_RUNS_KEY, run_id)
            pipe.zrem(CREATED_RUNS_KEY, run_id)
            pipe.zrem(AWAITING_APPROVAL_KEY, run_id)
            pipe.execute()

    def awaiting_approval(self) -> list[str]:
        """The runs that asked a person about a call and may still be waiting, oldest first."""
        with reachable("awaiting_approval"):
            return cast(list[str], self.client.zrange(AWAITING_APPROVAL_KEY, 0, -1))

    def done_awaiting(self, run_id: str) -> None:
        """The run no longer runs, so no call of it awaits a person any more."""
        with reachable("done_awaiting"):
            self.client.zrem(AWAITING_APPROVAL_KEY, run_id)

    # -- forward path ---------------------------------------------------------------------

    def view(self, run_id: str) -> RunView | None:
        keys = run_keys(run_id)
        with reachable("view"), self.client.pipeline(transaction=True) as pipe:
            pipe.hgetall(keys[0])
            pipe.hgetall(keys[2])
            run, inflight = pipe.execute()
        if not run:
            return None
        return RunView(
            run_id=run_id,
            state=RunState(run["state"]),
            version=run["version"],
            pivot_step=int(run["pivot"]) if run["pivot"] else None,
            in_flight={int(k): ToolClass(int(v)) for k, v in inflight.items()},
            allow_after_pivot=run.get("allow_after_pivot") == "1",
        )

    def reserve(
        self,
        run_id: str,
        tool: str,
        tool_class: ToolClass,
        args_json: str,
        gate: CallGate,
        marker: str = "",
        on_failure: str = "",
    ) -> Outcome:
        """Reserve the next step if ``gate`` holds right now: ``ok`` with the step number,
        or ``refused`` / ``ended`` / ``unknown``, having changed nothing; ``dup`` with the
        step a call with this ``marker`` got before. ``on_failure="feed_back"``: a final
        failure of the step is recorded as ``rejected`` and the run goes on."""
        unsettled = ",".join(str(int(c)) for c in sorted(gate.unsettled_classes))
        before_pivot = int(gate.before_pivot)
        return self._call(
            "reserve",
            run_id,
            tool,
            int(tool_class),
            args_json,
            unsettled,
            before_pivot,
            marker,
            on_failure,
        )

    def release(self, run_id: str, step: int, error: dict[str, Any]) -> Outcome:
        """The broker refused the step's message: ``ok`` (released), or ``started`` with the
        state a delivery already moved it to (the message got through after all)."""
        return self._call("release", run_id, step, _error_json(error), step=step)

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

    def mark_sent(self, run_id: str, owner: str) -> bool:
        return self._call("mark_sent", run_id, owner).status == "1"

    def mark_refused(self, run_id: str, owner: str) -> bool:
        """The broker refused the unwind of ``owner`` (still the owner, nothing sent)."""
        return self._call("mark_refused", run_id, owner).status == "1"

    def refused(self, run_id: str) -> str:
        """The owner whose unwind the broker refused last ('' if none was)."""
        with reachable("refused"):
            return cast(str, self.client.hget(run_keys(run_id)[0], "refused") or "")

    # -- unwind path ----------------------------------------------------------------------

    def begin_compensation(
        self, run_id: str, step: int, claim: str, task_id: str, unwind: str, lease: float
    ) -> Outcome:
        return self._call("begin_compensation", run_id, step, claim, task_id, unwind, lease)

    def record_compensation(
        self,
        run_id: str,
        step: int,
        outcome: str,
        error: dict[str, Any] | None = None,
        claim: str = "",
        owner: str = "",
    ) -> Outcome:
        """``outcome``: ``done``, ``fail``, ``retry`` (by the claim's holder) or ``revoke`` (for
        the unwind of ``owner``; ``claim=REVOKE_KILLED`` when the execution died by SIGKILL)."""
        return self._call(
            "record_compensation", run_id, step, outcome, _error_json(error), claim, owner
        )

    def conclude(
        self, run_id: str, state: RunState, reason: str = "", owner: str = "", version: str = ""
    ) -> Outcome:
        """``version``: conclude only if the run is still at it (``moved`` otherwise)."""
        return self._call("conclude", run_id, state.value, reason, owner, version)

    def mark_recorded(self, run_id: str, version: str, notify: bool = True) -> bool:
        """The record of ``version`` is written: let the keys expire, and (``notify``) wake
        whoever waits for the run's end."""
        args = (version, self.retention_seconds, int(notify))
        return self._call("mark_recorded", run_id, *args, extra=ended_key(run_id)).status == "ok"

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

    def ask_model(
        self, run_id: str, turn: int, lease_seconds: float, token: str, most: int = 0
    ) -> str:
        """Take turn ``turn``'s lease under ``token`` and count the policy call it is taken
        for: ``ok``; else nothing counted: ``busy`` while another delivery holds the lease,
        ``answered`` when the turn's answer is recorded, ``spent`` when the turn has been
        asked ``most`` times already (0: no limit)."""
        lease_ms = max(1, int(lease_seconds * 1000))
        lease = turn_lease_key(run_id, turn)
        return str(self._call("ask_model", run_id, turn, lease_ms, token, most, extra=lease).status)

    def renew_turn_lease(self, run_id: str, turn: int, token: str, lease_seconds: float) -> bool:
        """Extend the turn's lease if ``token`` still holds it; False if it does not."""
        lease_ms = max(1, int(lease_seconds * 1000))
        lease = turn_lease_key(run_id, turn)
        outcome = self._call("turn_lease", run_id, "renew", token, lease_ms, extra=lease)
        return outcome.status == "ok"

    def release_turn_lease(self, run_id: str, turn: int, token: str) -> None:
        """End the turn's lease if ``token`` still holds it (a model call with no answer)."""
        self._call("turn_lease", run_id, "release", token, 0, extra=turn_lease_key(run_id, turn))

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
        writer wins. Indexed first (``AWAITING_APPROVAL_KEY``): a request the index missed
        would be listed nowhere but on its run."""
        with reachable("request_approval"):
            self.client.zadd(AWAITING_APPROVAL_KEY, {run_id: self.now()}, nx=True)
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
        with reachable("adopt_deadline"):
            # Sooner only (ZADD LT needs Redis 6.2); a look that comes early is harmless: the
            # reaper reads the run's own deadline and schedules the next.
            due = float(outcome.values[0]) + deadline
            current = self.client.zscore(ACTIVE_RUNS_KEY, run_id)
            if current is None or due < float(current):
                self.client.zadd(ACTIVE_RUNS_KEY, {run_id: due})
        return True

    def count_revival(self, run_id: str) -> int:
        """The reaper sends a stalled hosted turn again: how often for this stall."""
        return int(self._call("count_revival", run_id).values[0])

    # -- reading --------------------------------------------------------------------------

    def head(self, run_id: str) -> RunHead | None:
        with reachable("head"):
            return head_of(self.client.hmget(run_keys(run_id)[0], HEAD_FIELDS))

    def owner(self, run_id: str) -> str:
        with reachable("owner"):
            return cast(str, self.client.hget(run_keys(run_id)[0], "owner") or "")

    def in_flight(self, run_id: str, step: int) -> bool:
        with reachable("in_flight"):
            return bool(self.client.hexists(run_keys(run_id)[2], str(step)))

    def step_outcome(self, run_id: str, step: int) -> tuple[str | None, str | None, str | None]:
        """The step's state, result and error as stored."""
        fields = (f"{step}:state", f"{step}:result", f"{step}:error")
        with reachable("step_outcome"):
            state, result, error = self.client.hmget(run_keys(run_id)[1], fields)
        return cast(tuple[str | None, str | None, str | None], (state, result, error))

    def wait_outcome(
        self, run_id: str, step: int, timeout: float
    ) -> tuple[str | None, str | None, str | None]:
        """Block until the step's scripts signal it settled (or ``timeout`` passes), then read
        its outcome as ``step_outcome`` does: both in one round trip (Redis runs a pipeline's
        commands in order, so the read waits behind the blocking pop)."""
        fields = (f"{step}:state", f"{step}:result", f"{step}:error")
        with reachable("wait_outcome"), self.client.pipeline(transaction=False) as pipe:
            pipe.blpop([settled_key(run_id, step)], timeout=max(timeout, 0.001))
            pipe.hmget(run_keys(run_id)[1], fields)
            _, (state, result, error) = pipe.execute()
        return cast(tuple[str | None, str | None, str | None], (state, result, error))

    def wait_signal(self, keys: list[str], timeout: float, keep: bool = False) -> bool:
        """Block until one of ``keys`` (settle signals: lists the scripts push to) has a
        signal, or ``timeout`` passes; True if one came. ``keep``: put it back for another
        waiter (it expires as the script's would)."""
        with reachable("wait_signal"):
            popped = self.client.blpop(keys, timeout=max(timeout, 0.001))
            if popped is None:
                return False
            if keep:
                with self.client.pipeline(transaction=False) as pipe:
                    pipe.lpush(popped[0], popped[1])
                    pipe.expire(popped[0], _SIGNAL_EXPIRY)
                    pipe.execute()
        return True

    def picture(self, run_id: str) -> RunPicture | None:
        with reachable("picture"), self.client.pipeline(transaction=True) as pipe:
            read_picture(pipe, run_id)
            return picture_of(run_id, pipe.execute())

    def complete(self, run_id: str) -> tuple[Outcome, RunPicture | None]:
        """Conclude a running run as completed and read it back, in one transaction (one
        round trip): the outcome, and the picture as the conclusion left it."""
        args = [RunState.COMPLETED.value, "", ""]

        def queue(pipe: Any) -> None:
            self._queue_script(pipe, "conclude", run_id, args)
            read_picture(pipe, run_id)

        raw, *read = self._pipelined("conclude", queue, transaction=True)
        return outcome_of("conclude", run_id, raw, args), picture_of(run_id, read)


def queue_script(pipe: Any, sha: str, run_id: str, args: Sequence[Any]) -> None:
    """Queue the script of ``sha`` on ``pipe`` (sync or asyncio) by its SHA alone: redis-py's
    own pipelined scripts cost a SCRIPT EXISTS round trip on every execute."""
    keys = script_keys(run_id)
    pipe.evalsha(sha, len(keys), *keys, *args)


def queue_create(pipe: Any, sha: str, run_id: str, args: Sequence[Any]) -> None:
    """Queue a run's creation (``RunStore.create`` says why in this order) on ``pipe``: the
    indexes, then ``create.lua`` (``sha``) with ``args``, whose 5th is the creation time."""
    created, deadline = float(args[4]), float(args[1])
    pipe.zadd(ACTIVE_RUNS_KEY, {run_id: created + deadline})
    pipe.zadd(CREATED_RUNS_KEY, {run_id: created}, nx=True)
    queue_script(pipe, sha, run_id, args)


def script_missing(answers: Sequence[Any]) -> bool:
    """A pipeline's answers say Redis did not have a script (it restarted): load and repeat."""
    return any(isinstance(answer, NoScriptError) for answer in answers)


def raise_first_error(answers: Sequence[Any]) -> None:
    """A pipeline run with ``raise_on_error=False`` fails as its first failed command."""
    for answer in answers:
        if isinstance(answer, Exception):
            raise answer


#: The run hash's fields a ``RunHead`` is read from, in ``head_of``'s order.
HEAD_FIELDS = ("state", "updated", "deadline", "recorded", "ended")


def head_of(values: Sequence[Any]) -> RunHead | None:
    """The head of a run from its ``HEAD_FIELDS``; None when the run has no keys."""
    state, updated, deadline, recorded, ended = values
    if state is None:
        return None
    return RunHead(
        state=RunState(str(state)),
        updated=float(updated or 0),
        deadline=float(deadline or 0),
        recorded=recorded == "1",
        ended=float(ended) if ended else None,
    )


def outcome_of(script: str, run_id: str, raw: Any, args: Any) -> Outcome:
    """A script's answer as an ``Outcome``; a transition its table refused is logged."""
    outcome = Outcome(str(raw[0]), tuple(raw[1:])) if isinstance(raw, list) else Outcome(str(raw))
    if outcome.status == ILLEGAL:
        machine, source, event = (str(v) for v in outcome.values)
        logger.error(
            "run %s: refused %s transition %r --%s--> (not in saga/machine.py's table; %s %s)",
            run_id,
            machine,
            source,
            event,
            script,
            list(args)[:1],
        )
    return outcome


def read_picture(pipe: Any, run_id: str) -> None:
    """Queue the reads of a whole run on ``pipe`` (``picture_of`` makes their answers one)."""
    run_key, steps_key, inflight_key, stack_key, comps_key = run_keys(run_id)
    pipe.hgetall(run_key)
    pipe.hgetall(steps_key)
    pipe.lrange(stack_key, 0, -1)
    pipe.hgetall(comps_key)
    pipe.hkeys(inflight_key)
    pipe.hgetall(agent_key(run_id))


def picture_of(run_id: str, read: list[Any]) -> RunPicture | None:
    run, steps, stack, comps, inflight, agent = read
    if not run:
        return None
    return picture_from(run_id, run, steps, stack, comps, inflight, agent)


@contextmanager
def reachable(what: str) -> Iterator[None]:
    """Redis being away is a saga error the caller can retry, not a library traceback."""
    try:
        yield
    except redis.AuthenticationError as exc:  # retrying will not fix a wrong password
        raise ConfigurationError(f"the saga store refused the credentials ({what}): {exc}") from exc
    except (redis.ConnectionError, redis.TimeoutError) as exc:
        raise StoreUnavailableError(f"saga store unreachable ({what}): {exc}") from exc


def _error_json(error: dict[str, Any] | None) -> str:
    if error is None:
        return ""
    return payload.dumps(error, what="error", limit=1 << 20)
