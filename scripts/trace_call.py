"""The path of one tool call through saga's modules, as ``docs/architecture.md`` describes it.

``Run.call("issue_credit", ...)`` on the demo app, then its task run in this process (the
message it published, taken off the broker's queue by hand), each traced with
``sys.setprofile``: every call from one saga module into another (``tasks.*``, the demo's
tools, counts as the tool). Printed for each side: the modules entered, in order of first
entry, and the calls into a higher layer than the caller's (by the layers of
``[tool.importlinter]`` in ``pyproject.toml``).

Usage: ``scripts/with-redis .venv/bin/python scripts/trace_call.py [CHECKOUT]`` (it uses
Redis database 15 of ``SAGA_REDIS_URL`` and flushes it). ``CHECKOUT``: another checkout of
saga to trace (an earlier commit's ``git worktree``), judged by this one's layers.
"""

from __future__ import annotations

import os
import sys
import tempfile
import tomllib
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def layers() -> dict[str, int]:
    """Module -> its layer's index (0 is the top), from the import-linter contract."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    contract = config["tool"]["importlinter"]["contracts"][0]
    found: dict[str, int] = {}
    for index, layer in enumerate(contract["layers"]):
        for module in layer.replace("|", ":").split(":"):
            found[module.strip()] = index
    return found


def layer_of(module: str, known: dict[str, int]) -> int | None:
    parts = module.split(".")
    while parts:
        if ".".join(parts) in known:
            return known[".".join(parts)]
        parts.pop()
    return None


def trace(call: Callable[[], Any]) -> list[tuple[str, str]]:
    """Every call from one module of saga (or the demo's tools) into another, in order."""
    crossings: list[tuple[str, str]] = []

    def ours(name: str) -> bool:
        return name == "saga" or name.startswith(("saga.", "tasks."))

    def profile(frame: FrameType, event: str, _arg: Any) -> None:
        if event != "call" or frame.f_back is None:
            return
        callee = frame.f_globals.get("__name__", "")
        caller = frame.f_back.f_globals.get("__name__", "")
        if ours(callee) and ours(caller) and callee != caller:
            crossings.append((caller, callee))

    sys.setprofile(profile)
    try:
        call()
    finally:
        sys.setprofile(None)
    return crossings


def report(side: str, crossings: list[tuple[str, str]], known: dict[str, int]) -> None:
    entered: list[str] = []
    for caller, callee in crossings:
        for module in (caller, callee):
            name = "the tool" if module.startswith("tasks.") else module
            if name not in entered:
                entered.append(name)
    upward = []
    for caller, callee in crossings:
        low, high = layer_of(caller, known), layer_of(callee, known)
        if low is not None and high is not None and high < low:
            upward.append(f"{caller} -> {callee}")
    print(f"{side}: {len(entered)} modules: {' '.join(entered)}")
    distinct = sorted(set(upward))
    print(f"  {len(upward)} call(s) into a higher layer, {len(distinct)} distinct: ", end="")
    print(", ".join(distinct) or "-")


def main() -> int:
    base = os.environ.get("SAGA_REDIS_URL", "redis://localhost:6379").rstrip("/")
    url = f"{base}/15"
    data = Path(tempfile.mkdtemp(prefix="saga-trace-"))
    os.environ.update(
        SAGA_REDIS_URL=url,
        SAGA_BROKER_URL=url,
        SAGA_RESULT_BACKEND=url,
        SAGA_DEMO_DATA=str(data),
        SAGA_DATABASE_URL=f"sqlite:///{data / 'saga.db'}",
    )
    checkout = Path(sys.argv[1]).resolve() if len(sys.argv) > 1 else ROOT
    sys.path.insert(0, str(checkout))
    os.chdir(checkout)  # celeryconfig.py
    import redis

    redis.Redis.from_url(url).flushdb()
    from saga.tool_hosts import publish_worker_tools
    from tasks import systems
    from tasks.app import app, saga

    systems.reset()
    known = layers()
    run = saga.start_run()
    args = {"order_id": 4921, "amount_cents": 250_000, "memo": "late delivery"}
    sent: list[dict[str, Any]] = []
    original = app.send_task

    def capture(name: str, *a: Any, **kw: Any) -> Any:
        sent.append({"name": name, **kw})
        return original(name, *a, **kw)

    app.send_task = capture  # type: ignore[method-assign]
    # What a worker of the demo app publishes at its start: the tools it runs.
    publish_worker_tools(saga.store.client, [tool.name for tool in saga.registry])
    handles: list[Any] = []
    report("caller", trace(lambda: handles.append(run.call("issue_credit", **args))), known)
    message = sent[0]
    task = app.tasks[message["name"]]
    report(
        "worker",
        trace(lambda: task.apply(kwargs=message["kwargs"], task_id=message["task_id"])),
        known,
    )
    print(f"step {handles[0].step}: {saga.picture(run.run_id).step(handles[0].step).state}")
    redis.Redis.from_url(url).flushdb()
    return 0


if __name__ == "__main__":
    sys.exit(main())
