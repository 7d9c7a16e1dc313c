"""The JSON API: runs, approvals, escalations (bearer tokens), health (open)."""

from saga.web.api import approvals, escalations, health, reversals, runs

ROUTERS = [health.router, runs.router, approvals.router, reversals.router, escalations.router]

__all__ = ["ROUTERS"]
