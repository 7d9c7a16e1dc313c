"""Which Redis errors mean "not now": the one place saga tells a failover from a refusal.

During a failover (Sentinel promoting a replica, a master with ``min-replicas-to-write`` and
no replica in sight, a server loading its data set) Redis answers commands with errors that
go away by themselves: the same command a moment later succeeds. They are the store being
away, as a dropped connection is, so every caller of the store raises them as
``StoreUnavailableError`` (retryable) and every worker waits them out. Telling them apart is
done here and nowhere else: redis-py gives some a class of their own and others (NOREPLICAS,
UNBLOCKED) only a message, and a pipeline prefixes the message with the failed command.
"""

from __future__ import annotations

import redis
from redis.exceptions import (
    AskError,
    ClusterDownError,
    ClusterError,
    MasterDownError,
    ReadOnlyError,
    RedisClusterException,
    SlotNotCoveredError,
    TryAgainError,
)

__all__ = ["FAILOVER_CODES", "FailoverError", "error_code", "failover_answer", "unavailable"]

#: The error codes of a Redis that cannot take the command for now, and will again without
#: anything changed on this side: no good replicas (``min-replicas-to-write``), a demoted
#: master (READONLY), a replica whose master is away (``replica-serve-stale-data no``), a
#: server loading its data set, a blocked BRPOP cut short by a demotion, a cluster resharding
#: or without a quorum, a slot that moved.
FAILOVER_CODES = frozenset(
    {
        "NOREPLICAS",
        "READONLY",
        "MASTERDOWN",
        "LOADING",
        "UNBLOCKED",
        "TRYAGAIN",
        "CLUSTERDOWN",
        "MOVED",
        "ASK",
    }
)

#: What redis-py puts before a command's own error in a pipeline's.
_PIPELINE_PREFIX = "of pipeline caused error: "


class FailoverError(redis.ConnectionError, redis.ResponseError):
    """A failover answer raised as a lost connection, for code that recovers only from those
    (kombu's consumer and its publish retries): it is a ``ResponseError`` still, so a
    pipeline collects it as a command's error as it did."""


def error_code(exc: redis.RedisError) -> str:
    """The Redis error code of ``exc`` (``NOREPLICAS``, ``READONLY``, ...), ``""`` if none:
    the parser keeps it for the codes it knows, the message starts with it for the others."""
    if exc.status_code:
        return str(exc.status_code)
    message = str(exc.args[0]) if exc.args else ""
    if _PIPELINE_PREFIX in message:
        message = message.split(_PIPELINE_PREFIX, 1)[1]
    word = message.split(" ", 1)[0]
    return word if word.isupper() else ""


def failover_answer(exc: BaseException) -> bool:
    """Whether Redis answered ``exc`` because of a failover (it answered: the connection
    works, the server cannot take the command for now)."""
    if isinstance(exc, ReadOnlyError | MasterDownError | ClusterDownError | TryAgainError):
        return True
    # A slot moving (MOVED, ASK) that outlived the cluster client's own redirections: the
    # client learns the new layout, and the same command a moment later reaches its master.
    if isinstance(exc, AskError):  # MovedError is one
        return True
    return isinstance(exc, redis.ResponseError) and error_code(exc) in FAILOVER_CODES


def unavailable(exc: BaseException) -> bool:
    """Whether ``exc`` says the store is away for now (unreachable, timed out, reset, loading,
    failing over), so the same call later may succeed; a refused password is not (retrying
    will not fix it), nor any other answer."""
    if isinstance(exc, redis.AuthenticationError | redis.exceptions.AuthorizationError):
        return False
    if isinstance(exc, redis.ConnectionError | redis.TimeoutError | ConnectionResetError):
        return True  # LOADING is redis-py's BusyLoadingError, a ConnectionError
    # A cluster client that gave up redirecting and reconnecting (its retries spent while a
    # master failed over), or that knows no master for a slot yet: the cluster is away.
    if isinstance(exc, ClusterError | SlotNotCoveredError):
        return True
    if isinstance(exc, RedisClusterException) and "connect" in str(exc).lower():
        return True
    return failover_answer(exc)
