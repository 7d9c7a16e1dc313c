"""Retry settings for tools and compensations.

Compensations run where things are already broken, so they get at least the retry discipline of
the forward path: a bounded number of attempts, exponential backoff, full jitter, a cap.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from saga.errors import ToolDefinitionError

_RANDOM = random.Random()


@dataclass(frozen=True)
class RetryPolicy:
    attempts: int = 3
    backoff: float = 1.0
    backoff_max: float = 60.0
    jitter: bool = True

    def __post_init__(self) -> None:
        if self.attempts < 1:
            raise ToolDefinitionError(f"retry attempts must be at least 1, got {self.attempts}")
        if self.backoff < 0 or self.backoff_max < 0:
            raise ToolDefinitionError("retry backoff and backoff_max must not be negative")

    def delay(self, attempt: int, rng: random.Random | None = None) -> float:
        """Seconds to wait after the ``attempt``-th attempt (1-based) failed."""
        ceiling = min(self.backoff_max, self.backoff * 2.0 ** (attempt - 1))
        if not self.jitter:
            return ceiling
        return (rng or _RANDOM).uniform(0, ceiling)

    def allows_another(self, attempt: int) -> bool:
        return attempt < self.attempts


#: Default for forward steps.
DEFAULT_RETRY = RetryPolicy()
#: Default for compensations: more patient, because giving up means a person gets paged.
DEFAULT_COMPENSATION_RETRY = RetryPolicy(attempts=5, backoff=2.0, backoff_max=120.0)
