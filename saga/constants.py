"""Names that outlive a deploy: Redis keys and Celery task names.

They live here, spelled out, so a rename of a module never orphans a queued message or a stack.
Every key of one run shares the hash tag ``{run_id}`` so the Lua scripts also work on Redis
Cluster, where all keys a script touches must sit in one slot.
"""

from __future__ import annotations

KEY_PREFIX = "saga"

#: Sorted set of runs not yet ended, for the reaper (the one key outside any run's hash tag).
ACTIVE_RUNS_KEY = f"{KEY_PREFIX}:active"
#: Fault-injection rules and their counters (saga.testing), read only when explicitly enabled.
FAULTS_KEY = f"{KEY_PREFIX}:{{testing}}:faults"
FAULT_COUNTS_KEY = f"{KEY_PREFIX}:{{testing}}:fault-counts"

#: Celery task name of a tool: ``tools.issue_credit``.
TOOL_TASK_PREFIX = "tools."
#: Celery task that closes an unwind once its compensation chain has run.
CONCLUDE_UNWIND_TASK = "saga.conclude_unwind"
#: Celery beat task that resolves runs with no progress past their deadline.
REAP_TASK = "saga.reap"


def tool_task_name(tool: str) -> str:
    return f"{TOOL_TASK_PREFIX}{tool}"


def run_keys(run_id: str) -> list[str]:
    """The keys of one run, in the order every Lua script receives them.

    run      hash: state, pivot, counters, reason, version
    steps    hash: step number -> step record (JSON)
    inflight hash: step number -> tool class, for steps dispatched and not yet settled
    stack    list: compensation entries (JSON), oldest first
    comps    hash: step number -> compensation record (JSON)
    """
    base = f"{KEY_PREFIX}:{{{run_id}}}"
    return [f"{base}:run", f"{base}:steps", f"{base}:inflight", f"{base}:stack", f"{base}:comps"]


def settled_key(run_id: str, step: int) -> str:
    """The list a client waiting on ``step`` blocks on; the scripts push when it settles."""
    return f"{KEY_PREFIX}:{{{run_id}}}:settled:{step}"


def step_idempotency_key(run_id: str, step: int) -> str:
    return f"{run_id}:{step}"


def compensation_idempotency_key(run_id: str, step: int) -> str:
    return f"{run_id}:{step}:undo"
