"""Reading a run back without changing it: what the reaper, the waiters and the surfaces see.

Reads are plain commands, not scripts: a read changes nothing, so it needs no atomicity beyond
a transaction's snapshot. The shapes a run is read into (``RunHead`` for the reaper's glance,
``RunView`` for the rules, ``RunPicture`` for the whole run) and the queued reads that make
them live here so the asyncio client (``saga.aio``) reads a run exactly as the store does.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, cast

from saga.constants import agent_key, run_keys, settled_key
from saga.model import RunState, ToolClass
from saga.picture import RunPicture, RunView, picture_from
from saga.store_scripts import StoreCore, reachable


@dataclass(frozen=True)
class RunHead:
    """The few fields the reaper reads to decide whether a run needs a closer look."""

    state: RunState
    updated: float
    deadline: float
    recorded: bool
    ended: float | None
    #: The run's version (``""`` for keys written before versions were), and the latest
    #: one whose SQL record the keys saw written (``RunPicture.recorded_version``).
    version: str = ""
    recorded_version: str | None = None


#: The run hash's fields a ``RunHead`` is read from, in ``head_of``'s order.
HEAD_FIELDS = ("state", "updated", "deadline", "recorded", "ended", "version", "recorded_version")


def head_of(values: Sequence[Any]) -> RunHead | None:
    """The head of a run from its ``HEAD_FIELDS``; None when the run has no keys."""
    state, updated, deadline, recorded, ended, version, recorded_version = values
    if state is None:
        return None
    return RunHead(
        state=RunState(str(state)),
        updated=float(updated or 0),
        deadline=float(deadline or 0),
        recorded=recorded == "1",
        ended=float(ended) if ended else None,
        version=str(version or ""),
        recorded_version=None if recorded_version is None else str(recorded_version),
    )


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


#: Seconds a settle signal nobody took stays (as the scripts' ``notify`` sets it).
_SIGNAL_EXPIRY = 300


class RunReads(StoreCore):
    """The store's reads of one run: its view, head, owner, steps, settle signals, picture."""

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

    def head(self, run_id: str) -> RunHead | None:
        with reachable("head"):
            return head_of(self.client.hmget(run_keys(run_id)[0], HEAD_FIELDS))

    def owner(self, run_id: str) -> str:
        with reachable("owner"):
            return cast(str, self.client.hget(run_keys(run_id)[0], "owner") or "")

    def in_flight(self, run_id: str, step: int) -> bool:
        with reachable("in_flight"):
            return bool(self.client.hexists(run_keys(run_id)[2], str(step)))

    def refused(self, run_id: str) -> str:
        """The owner whose unwind the broker refused last ('' if none was)."""
        with reachable("refused"):
            return cast(str, self.client.hget(run_keys(run_id)[0], "refused") or "")

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
