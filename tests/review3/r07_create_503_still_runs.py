"""R07, adapted to the create contract: the review's reproduction of a create while the broker
is down, with the same interleaving, reading the run id from the answer's ``run_id`` field.

The original sends the retry without a run id and asserts a 503 first; under the contract
(docs/api.md, "A request applied whose message is not sent") a create whose run is recorded
while the broker refuses its first turn answers 202 ``not_sent`` with the run's id in
``run_id``, and a retry with that id converges on the same run. Run it from the review's
reproductions directory (it imports their ``rv3`` helper from there), as the original runs.

Steps: the broker (a redis-server on its own port) is down when ``saga serve`` gets
``POST /api/runs {"agent": "refund", "input": ...}`` -> 202 ``not_sent`` with ``run_id``. The
broker comes back, real workers of the demo app start; the client sends the same request
again, with that ``run_id`` -> 200, that run completes (one credit on order 4921). The
reaper's passes (``saga reap``) then find nothing left to play.
Expected: one run, one credit, one reply. The defect: two of them.
"""

from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.getcwd())  # the review's reproductions: rv3, rv3_app

import rv3

INPUT = "Order 4921 arrived late."


def credits() -> list[dict]:  # type: ignore[type-arg]
    from tasks import systems

    return [e for e in systems.ledger(4921) if e["kind"] == "credit"]


def main() -> None:
    rv3.fresh_redis()
    from saga.testing import RedisServer
    from tasks import systems

    systems.reset()
    broker = RedisServer()  # not started yet: the broker is down
    deadline = {"SAGA_RUN_DEADLINE": "5"}
    os.environ.update(deadline)
    rv3.ENV.update(deadline)
    server = rv3.Server({"SAGA_BROKER_URL": broker.url + "/0"})
    alice = server.api(rv3.token("alice", "operate"))

    first = alice.post("/api/runs", json={"agent": "refund", "input": INPUT})
    told = first.json()
    print(
        "POST /api/runs while the broker is down ->",
        first.status_code,
        told["error"],
        "| run_id:",
        told.get("run_id"),
        "applied:",
        told.get("applied"),
        "pending:",
        told.get("pending"),
        "Retry-After:",
        first.headers.get("retry-after"),
    )
    run_id = told.get("run_id")
    assert run_id, told

    broker.start()
    rv3.on_exit(broker.stop)
    os.environ["SAGA_BROKER_URL"] = rv3.ENV["SAGA_BROKER_URL"] = broker.url + "/0"
    rv3.workers(turns=True, tools=True)
    second = alice.post("/api/runs", json={"agent": "refund", "input": INPUT, "run_id": run_id})
    print("the same request again with its run_id, broker back ->", second.status_code)
    retried = second.json()["run_id"]

    def state(run_id: str) -> str:
        return str(alice.get(f"/api/runs/{run_id}").json()["state"])

    rv3.wait_until(lambda: state(retried) == "completed", 120, "the retried run to complete")
    print(f"retried run {retried}: completed; credits on order 4921: {len(credits())}")

    runs = alice.get("/api/runs").json()["runs"]
    orphans = [r["run_id"] for r in runs if r["run_id"] != retried and r["agent"] == "refund"]
    print("runs listed besides it:", [(r, state(r)) for r in orphans])

    # The reaper's passes past the deadline, as beat would run them: nothing left to play.
    until = time.monotonic() + 12
    while time.monotonic() < until:
        rv3.saga_cli("reap", "--json", check=False)
        time.sleep(2)
    found = credits()
    print(f"after the reaper's passes: credits on order 4921: {len(found)}")
    for entry in found:
        print("   ", entry["kind"], entry["amount_cents"], entry["idempotency_key"])
    print("replies in the outbox:", len(systems.outbox()))
    rv3.verdict(retried != run_id or bool(orphans) or len(found) != 1)


if __name__ == "__main__":
    main()
