"""The compensation stack and run state, in Redis.

This is workflow state: it must outlive any worker, so it lives in Redis and every change that
touches more than one key is a single Lua script (``saga/lua``). Steps follow the durable-step
rule: check the recorded outcome before running, record the outcome after, so a redelivered
message replays instead of re-executing.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from importlib import resources
from typing import TYPE_CHECKING, Any, cast

import redis
from redis.commands.core import Script

from saga import payload
from saga.constants import ACTIVE_RUNS_KEY, run_keys, settled_key
from saga.errors import ConfigurationError, StoreUnavailableError
from saga.model import CompensationState, RunState, StepState, ToolClass

if TYPE_CHECKING:
    from saga.rules import CallGate

_SCRIPTS = (
    "create",
    "reserve",
    "release",
    "begin_step",
    "record_success",
    "record_failure",
    "abort",
    "mark_sent",
    "begin_compensation",
    "record_compensation",
    "conclude",
    "requeue",
    "mark_in_doubt",
    "resolve_in_doubt",
    "take_over",
)


def _load_scripts(client: redis.Redis) -> dict[str, Script]:
    folder = resources.files("saga") / "lua"
    prelude = (folder / "_prelude.lua").read_text()
    return {
        name: client.register_script(prelude + "\n" + (folder / f"{name}.lua").read_text())
        for name in _SCRIPTS
    }


@dataclass(frozen=True)
class RunView:
    """What the dispatcher needs to judge a call, read at one version of the run."""

    run_id: str
    state: RunState
    version: str
    pivot_step: int | None
    in_flight: dict[int, ToolClass]
    allow_after_pivot: bool


@dataclass(frozen=True)
class StepRecord:
    step: int
    tool: str
    tool_class: ToolClass
    args: dict[str, Any]
    state: StepState
    attempts: int
    result: Any = None
    error: dict[str, Any] | None = None
    #: For a step that was in doubt: what its lookup found ("happened", "not_happened", ...).
    reconciled: str = ""
    #: When its current delivery started running (the caller's clock), if it did.
    started: float | None = None


@dataclass(frozen=True)
class CompensationRecord:
    step: int
    entry: dict[str, Any]
    state: CompensationState
    attempts: int
    error: dict[str, Any] | None = None
    #: When it was confirmed done (or given up on), by the Redis caller's clock.
    settled_at: float | None = None
    #: The Celery task that last ran it (what Flower shows, what ``revoke`` takes).
    task_id: str = ""


@dataclass(frozen=True)
class RunPicture:
    """Everything known about a run: what a person handed an escalation needs to see."""

    run_id: str
    state: RunState
    reason: str
    pivot_step: int | None
    steps: list[StepRecord]
    stack: list[dict[str, Any]]
    compensations: list[CompensationRecord]
    created: float
    ended: float | None
    extra: dict[str, str] = field(default_factory=dict)
    #: Last change, and how long the run may go without one before the reaper steps in.
    updated: float = 0.0
    deadline: float = 0.0
    #: Why the run must end escalated whatever its unwind does (a step left in doubt).
    doubt: str = ""
    in_flight: tuple[int, ...] = ()
    version: str = ""
    #: What set a failing run on its way ("step 4 failed", "aborted: ..."), once ``reason``
    #: holds the verdict ("compensation failed", ...).
    cause: str = ""

    def step(self, number: int) -> StepRecord:
        return next(s for s in self.steps if s.step == number)


@dataclass(frozen=True)
class Outcome:
    """What a script answered: a status word and whatever came with it."""

    status: str
    values: tuple[Any, ...] = ()

    @property
    def owns_unwind(self) -> bool:
        """True when this caller came to own the run's unwind (it must start it)."""
        return (
            self.status in ("ok", "dup", "skip")
            and bool(self.values)
            and self.values[0]
            in (
                1,
                "1",
            )
        )


class RunStore:
    """Reads and changes one Redis's runs; safe to share between threads."""

    def __init__(self, client: redis.Redis, retention_seconds: int) -> None:
        self.client = client
        self.retention_seconds = retention_seconds
        self._scripts = _load_scripts(client)

    @classmethod
    def from_url(cls, url: str, retention_seconds: int, **options: Any) -> RunStore:
        client = redis.Redis.from_url(url, decode_responses=True, **options)
        return cls(client, retention_seconds)

    def _call(self, script: str, run_id: str, *args: Any, step: int | None = None) -> Outcome:
        keys = run_keys(run_id)
        if step is not None:
            keys.append(settled_key(run_id, step))
        with _reachable(script):
            raw = self._scripts[script](keys=keys, args=list(args))
        if isinstance(raw, list):
            return Outcome(str(raw[0]), tuple(raw[1:]))
        return Outcome(str(raw))

    # -- forward path ---------------------------------------------------------------------

    def create(self, run_id: str, deadline: float, allow_after_pivot: bool = False) -> bool:
        # Indexed first: a run the reaper finds without keys is simply dropped from the index.
        with _reachable("create"):
            self.client.zadd(ACTIVE_RUNS_KEY, {run_id: time.time()})
        now = time.time()
        return self._call("create", run_id, now, int(allow_after_pivot), deadline).status == "1"

    def active_runs(self) -> list[str]:
        with _reachable("active_runs"):
            return cast(list[str], self.client.zrange(ACTIVE_RUNS_KEY, 0, -1))

    def forget(self, run_id: str) -> None:
        """Drop an ended (or vanished) run from the reaper's index."""
        with _reachable("forget"):
            self.client.zrem(ACTIVE_RUNS_KEY, run_id)

    def view(self, run_id: str) -> RunView | None:
        keys = run_keys(run_id)
        with _reachable("view"), self.client.pipeline(transaction=True) as pipe:
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
        self, run_id: str, tool: str, tool_class: ToolClass, args_json: str, gate: CallGate
    ) -> Outcome:
        """Reserve the next step if ``gate`` holds right now: ``ok`` with the step number,
        or ``refused`` / ``ended`` / ``unknown``, having changed nothing."""
        unsettled = ",".join(str(int(c)) for c in sorted(gate.unsettled_classes))
        before_pivot = int(gate.before_pivot)
        now = time.time()
        return self._call(
            "reserve", run_id, tool, int(tool_class), args_json, now, unsettled, before_pivot
        )

    def release(self, run_id: str, step: int, error: dict[str, Any]) -> Outcome:
        return self._call("release", run_id, step, _error_json(error), time.time(), step=step)

    def begin_step(self, run_id: str, step: int) -> Outcome:
        return self._call("begin_step", run_id, step, time.time(), step=step)

    def record_success(
        self, run_id: str, step: int, result_json: str, entry_json: str, irreversible: bool
    ) -> Outcome:
        return self._call(
            "record_success",
            run_id,
            step,
            result_json,
            entry_json,
            int(irreversible),
            time.time(),
            step=step,
        )

    def record_failure(self, run_id: str, step: int, error: dict[str, Any]) -> Outcome:
        error_json = _error_json(error)
        return self._call("record_failure", run_id, step, error_json, time.time(), step=step)

    def mark_in_doubt(self, run_id: str, step: int, error: dict[str, Any]) -> Outcome:
        error_json = _error_json(error)
        return self._call("mark_in_doubt", run_id, step, error_json, time.time(), step=step)

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
            time.time(),
            step=step,
        )

    def take_over(self, run_id: str, version: str, owner: str) -> bool:
        return self._call("take_over", run_id, version, owner, time.time()).status == "1"

    def abort(self, run_id: str, reason: str) -> Outcome:
        return self._call("abort", run_id, reason, time.time())

    def mark_sent(self, run_id: str, owner: str) -> bool:
        return self._call("mark_sent", run_id, owner).status == "1"

    # -- unwind path ----------------------------------------------------------------------

    def begin_compensation(
        self, run_id: str, step: int, task_id: str = "", unwind: str = ""
    ) -> Outcome:
        return self._call("begin_compensation", run_id, step, time.time(), task_id, unwind)

    def record_compensation(
        self, run_id: str, step: int, outcome: str, error: dict[str, Any] | None = None
    ) -> str:
        return self._call(
            "record_compensation", run_id, step, outcome, _error_json(error), time.time()
        ).status

    def conclude(self, run_id: str, state: RunState, reason: str = "", owner: str = "") -> Outcome:
        return self._call(
            "conclude", run_id, state.value, reason, time.time(), self.retention_seconds, owner
        )

    def requeue(self, run_id: str) -> Outcome:
        return self._call("requeue", run_id, time.time())

    def owner(self, run_id: str) -> str:
        with _reachable("owner"):
            return cast(str, self.client.hget(run_keys(run_id)[0], "owner") or "")

    def in_flight(self, run_id: str, step: int) -> bool:
        with _reachable("in_flight"):
            return bool(self.client.hexists(run_keys(run_id)[2], str(step)))

    def step_outcome(self, run_id: str, step: int) -> tuple[str | None, str | None, str | None]:
        """The step's state, result and error as stored."""
        fields = (f"{step}:state", f"{step}:result", f"{step}:error")
        with _reachable("step_outcome"):
            state, result, error = self.client.hmget(run_keys(run_id)[1], fields)
        return cast(tuple[str | None, str | None, str | None], (state, result, error))

    def wait_settled(self, run_id: str, step: int, timeout: float) -> None:
        """Block until the step's scripts signal it settled, or ``timeout`` passes."""
        with _reachable("wait_settled"):
            self.client.blpop([settled_key(run_id, step)], timeout=max(timeout, 0.001))

    # -- reading --------------------------------------------------------------------------

    def picture(self, run_id: str) -> RunPicture | None:
        run_key, steps_key, inflight_key, stack_key, comps_key = run_keys(run_id)
        with _reachable("picture"), self.client.pipeline(transaction=True) as pipe:
            pipe.hgetall(run_key)
            pipe.hgetall(steps_key)
            pipe.lrange(stack_key, 0, -1)
            pipe.hgetall(comps_key)
            pipe.hkeys(inflight_key)
            run, steps, stack, comps, inflight = pipe.execute()
        if not run:
            return None
        return RunPicture(
            run_id=run_id,
            state=RunState(run["state"]),
            reason=run.get("reason", ""),
            pivot_step=int(run["pivot"]) if run.get("pivot") else None,
            steps=_steps_from(steps, int(run.get("next_step", 0))),
            stack=[payload.loads(e) for e in stack],
            compensations=_compensations_from(comps),
            created=float(run["created"]),
            ended=float(run["ended"]) if run.get("ended") else None,
            extra={k: run[k] for k in ("owner", "sent", "generation") if k in run},
            updated=float(run.get("updated") or run["created"]),
            deadline=float(run.get("deadline") or 0),
            doubt=run.get("doubt", ""),
            in_flight=tuple(sorted(int(s) for s in inflight)),
            version=run.get("version", ""),
            cause=run.get("cause", ""),
        )


@contextmanager
def _reachable(what: str) -> Iterator[None]:
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


def _steps_from(fields: dict[str, str], count: int) -> list[StepRecord]:
    steps = []
    for n in range(1, count + 1):
        if f"{n}:tool" not in fields:
            continue
        steps.append(
            StepRecord(
                step=n,
                tool=fields[f"{n}:tool"],
                tool_class=ToolClass(int(fields[f"{n}:class"])),
                args=payload.loads(fields[f"{n}:args"]),
                state=StepState(fields[f"{n}:state"]),
                attempts=int(fields.get(f"{n}:attempts", 0)),
                result=payload.loads(fields.get(f"{n}:result")),
                error=payload.loads(fields.get(f"{n}:error") or None),
                reconciled=fields.get(f"{n}:reconciled", ""),
                started=float(fields[f"{n}:started"]) if f"{n}:started" in fields else None,
            )
        )
    return steps


def _compensations_from(fields: dict[str, str]) -> list[CompensationRecord]:
    numbers = sorted({int(k.split(":")[0]) for k in fields})
    return [
        CompensationRecord(
            step=n,
            entry=payload.loads(fields[f"{n}:entry"]),
            state=CompensationState(fields[f"{n}:state"]),
            attempts=int(fields.get(f"{n}:attempts", 0)),
            error=payload.loads(fields.get(f"{n}:error") or None),
            settled_at=float(fields[f"{n}:at"]) if f"{n}:at" in fields else None,
            task_id=fields.get(f"{n}:task_id", ""),
        )
        for n in numbers
    ]
