"""``saga.aio.AsyncClient`` from a real ASGI app (FastAPI over httpx's ASGI transport, in the
test's event loop) against the real Redis and the real workers of the hosted tests
(``tests/integration/hosted_app.py``): concurrent requests, a heartbeat that keeps ticking
while calls wait on Redis or on a broker that does not answer, and the failure paths.
"""

from __future__ import annotations

import asyncio
import dataclasses
import socket
import threading
import uuid
from collections.abc import Awaitable, Callable, Coroutine, Iterator
from typing import Any, TypeVar

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from saga.aio import AsyncClient
from saga.client import Client
from saga.errors import (
    ConfigurationError,
    MessageNotSentError,
    RunEndedError,
    SagaError,
    StoreUnavailableError,
    UnknownAgentError,
    UnknownRunError,
)
from saga.settings import Settings
from saga.testing import WorkerProcess
from tasks import systems

pytestmark = pytest.mark.timeout(90)

T = TypeVar("T")


def run(main: Callable[[], Coroutine[Any, Any, T]]) -> T:
    return asyncio.run(main())


def web_app(client: AsyncClient) -> FastAPI:
    """A web app as a user writes one: each route awaits one call of the client."""
    app = FastAPI()

    @app.exception_handler(SagaError)
    async def refused(request: Request, exc: SagaError) -> JSONResponse:
        return JSONResponse({"error": type(exc).__name__, "detail": str(exc)}, status_code=409)

    @app.post("/runs")
    async def start(body: dict[str, Any]) -> dict[str, str]:
        run_id = await client.enqueue_run(body["agent"], body["input"], body.get("run_id"))
        return {"run_id": run_id}

    @app.get("/runs")
    async def listing(agent: str | None = None, limit: int = 50) -> list[dict[str, Any]]:
        return [dataclasses.asdict(s) for s in await client.list_runs(agent, limit)]

    @app.get("/runs/{run_id}")
    async def status(run_id: str) -> dict[str, Any]:
        return (await client.get_run(run_id)).to_dict()

    @app.get("/runs/{run_id}/ended")
    async def ended(run_id: str) -> dict[str, Any]:
        return (await client.wait_run(run_id, timeout=45)).to_dict()

    @app.post("/runs/{run_id}/approvals/{approval_id}")
    async def decide(run_id: str, approval_id: str, body: dict[str, str]) -> dict[str, str]:
        if body["verdict"] == "approve":
            applied = await client.approve(
                run_id, approval_id, args_hash=body["args_hash"], by="ops@acme"
            )
        else:
            applied = await client.deny(
                run_id, approval_id, body["reason"], args_hash=body["args_hash"], by="ops@acme"
            )
        return {"applied": "now" if applied else "already"}

    @app.post("/runs/{run_id}/abort")
    async def abort(run_id: str) -> dict[str, str]:
        applied = await client.abort_run(run_id, "the customer called back")
        return {"applied": "now" if applied else "already"}

    return app


async def ticking(call: Awaitable[T]) -> tuple[T | BaseException, int]:
    """What ``call`` answered (or raised), and how often a heartbeat coroutine beside it
    ran meanwhile: it runs only if the call gives the event loop back while it waits."""
    ticks = 0

    async def beat() -> None:
        nonlocal ticks
        while True:
            await asyncio.sleep(0.01)
            ticks += 1

    heart = asyncio.create_task(beat())
    try:
        answer: T | BaseException = await call
    except Exception as exc:
        answer = exc
    finally:
        heart.cancel()
    return answer, ticks


@pytest.fixture
def hosted(turn_worker: WorkerProcess, saga: Any, redis_url: str) -> Iterator[str]:
    """The hosted agents' workers are up; the Redis URL they use (their broker is the
    session's SAGA_BROKER_URL, or follows this URL)."""
    yield redis_url


def closed_port() -> int:
    """A local port nothing listens on (connections are refused)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
    return port


class SilentServer:
    """A local port that accepts connections and never answers (a Redis or broker that
    hangs) until ``release()``, which refuses new connections and closes the held ones, so
    whatever waits on one ends at once."""

    def __init__(self) -> None:
        self.server = socket.create_server(("127.0.0.1", 0))
        self.server.settimeout(0.1)
        self.port = int(self.server.getsockname()[1])
        self.held: list[socket.socket] = []
        self.stop = threading.Event()
        self.acceptor = threading.Thread(target=self._accept, daemon=True)
        self.acceptor.start()

    def _accept(self) -> None:
        while not self.stop.is_set():
            try:
                self.held.append(self.server.accept()[0])
            except TimeoutError:
                continue
            except OSError:
                return

    def release(self) -> None:
        self.stop.set()
        self.acceptor.join(5)
        self.server.close()
        for connection in self.held:
            connection.close()


@pytest.fixture
def silent_server() -> Iterator[SilentServer]:
    server = SilentServer()
    yield server
    server.release()


def http(app: FastAPI) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://web")


async def pending_approval(web: httpx.AsyncClient, run_id: str) -> dict[str, Any]:
    for _ in range(400):  # bounded: 20 s
        status = (await web.get(f"/runs/{run_id}")).json()
        if status["awaiting_approval"]:
            found: dict[str, Any] = status["pending_approvals"][0]
            return found
        await asyncio.sleep(0.05)
    pytest.fail(f"run {run_id} never asked for an approval")


def test_concurrent_requests_start_and_wait_for_runs_while_the_loop_keeps_running(
    hosted: str,
) -> None:
    """Six runs started at once over HTTP, then six requests each waiting for its run's
    end: all complete, and the heartbeat beside them ticked while they waited. (The agent
    thinks for a while: an agent that answers at once can end its runs before the waits are
    even made, and then nothing was pending.)"""

    async def main() -> tuple[list[dict[str, Any]], list[dict[str, Any]], int]:
        async with AsyncClient(redis_url=hosted) as client, http(web_app(client)) as web:
            starts = await asyncio.gather(
                *(web.post("/runs", json={"agent": "slow", "input": "Hi."}) for _ in range(6))
            )
            run_ids = [r.json()["run_id"] for r in starts]
            waits, ticks = await ticking(
                asyncio.gather(*(web.get(f"/runs/{run_id}/ended") for run_id in run_ids))
            )
            assert not isinstance(waits, BaseException), waits
            listed = (await web.get("/runs", params={"agent": "slow", "limit": 6})).json()
            return [w.json() for w in waits], listed, ticks

    ended, listed, ticks = run(main)

    assert [s["state"] for s in ended] == ["completed"] * 6
    assert all(s["final_text"] == "Done." for s in ended)
    assert {row["run_id"] for row in listed} == {s["run_id"] for s in ended}
    assert ticks >= 3  # the loop ran while the six waits were pending


def test_a_run_is_approved_or_denied_through_the_async_client(hosted: str) -> None:
    """The approval a run waits for, decided over HTTP: a wrong hash is refused, the right
    one lets the reply go out once; a denial is fed back to the model."""

    async def main() -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
        async with AsyncClient(redis_url=hosted) as client, http(web_app(client)) as web:
            approved = await web.post("/runs", json={"agent": "approver", "input": "Tell Ada."})
            denied = await web.post("/runs", json={"agent": "approver", "input": "Tell Ada."})
            first, second = approved.json()["run_id"], denied.json()["run_id"]
            pending = await pending_approval(web, first)
            wrong = await web.post(
                f"/runs/{first}/approvals/{pending['id']}",
                json={"verdict": "approve", "args_hash": "0" * 64},
            )
            assert wrong.status_code == 409 and wrong.json()["error"] == "ApprovalError"
            ok = await web.post(
                f"/runs/{first}/approvals/{pending['id']}",
                json={"verdict": "approve", "args_hash": pending["args_hash"]},
            )
            assert ok.status_code == 200
            other = await pending_approval(web, second)
            body = {"verdict": "deny", "args_hash": other["args_hash"], "reason": "not now"}
            assert (await web.post(f"/runs/{second}/approvals/1:0", json=body)).is_success
            again = await web.post(
                f"/runs/{first}/approvals/1:0",
                json={"verdict": "approve", "args_hash": pending["args_hash"]},
            )
            one = (await web.get(f"/runs/{first}/ended")).json()
            two = (await web.get(f"/runs/{second}/ended")).json()
            return again.json(), one, two

    again, approved, denied = run(main)

    assert approved["state"] == "completed" and approved["final_text"] == "Sent."
    # The same decision again by the same person is no refusal: applied already.
    assert again == {"applied": "already"}
    assert denied["state"] == "completed"
    assert denied["final_text"] == "Not sent: a person (ops@acme) declined send_reply: not now"
    assert len(systems.outbox()) == 1


def test_an_aborted_run_unwinds_and_a_second_abort_says_it_ended(hosted: str) -> None:
    """abort_run over HTTP stops a run waiting for a person: it ends compensated, and an
    abort of the ended run is RunEndedError; an unknown run is UnknownRunError."""

    async def main(client: AsyncClient) -> tuple[dict[str, Any], Any, Any]:
        async with http(web_app(client)) as web:
            started = await web.post("/runs", json={"agent": "approver", "input": "Tell Ada."})
            run_id = started.json()["run_id"]
            await pending_approval(web, run_id)
            assert (await web.post(f"/runs/{run_id}/abort")).is_success
            ended = (await web.get(f"/runs/{run_id}/ended")).json()
        late, _ = await ticking(client.abort_run(run_id))
        unknown, _ = await ticking(client.get_run("no-such-run"))
        return ended, late, unknown

    async def with_client() -> tuple[dict[str, Any], Any, Any]:
        async with AsyncClient(redis_url=hosted) as client:
            return await main(client)

    ended, late, unknown = run(with_client)

    assert ended["state"] == "compensated" and "customer called back" in ended["reason"]
    assert isinstance(late, RunEndedError)
    assert isinstance(unknown, UnknownRunError)
    assert systems.outbox() == []


def test_the_async_listing_and_status_are_the_sync_clients(hosted: str) -> None:
    """list_runs and get_run answer exactly what saga.client answers for the same runs."""
    sync = Client(redis_url=hosted)  # the session's broker (SAGA_BROKER_URL, or this URL)

    async def main() -> tuple[list[Any], Any, str]:
        async with AsyncClient(redis_url=hosted) as client:
            run_ids = [await client.enqueue_run("patient", "Hi.") for _ in range(3)]
            for run_id in run_ids:
                await client.wait_run(run_id, timeout=30)
            return (
                await client.list_runs("patient", 2),
                await client.get_run(run_ids[0]),
                run_ids[0],
            )

    try:
        listed, status, run_id = run(main)
        assert listed == sync.list_runs("patient", 2) and len(listed) == 2
        assert status == sync.get_run(run_id)
    finally:
        sync.store.client.close()


def test_an_agent_no_worker_hosts_is_refused(hosted: str) -> None:
    async def main() -> Any:
        async with AsyncClient(redis_url=hosted) as client:
            refused, _ = await ticking(client.enqueue_run("nobody", "Hi."))
            return refused

    refused = run(main)
    assert isinstance(refused, UnknownAgentError) and "patient" in str(refused)


def test_scripts_redis_forgot_are_loaded_again(hosted: str, redis_client: Any) -> None:
    """After SCRIPT FLUSH (as after a restart) a run is created and aborted all the same: the
    pipelined create and the EVALSHA of abort load their script on NOSCRIPT."""

    async def main() -> tuple[str, Any]:
        async with AsyncClient(redis_url=hosted) as client:
            run_id = await client.enqueue_run("approver", "Tell Ada.")
            for _ in range(400):
                if (await client.get_run(run_id)).awaiting_approval:
                    break
                await asyncio.sleep(0.05)
            redis_client.script_flush()
            await client.abort_run(run_id, "flushed")
            created = await client.enqueue_run("patient", "Hi.")  # flushed again below
            return created, await client.wait_run(created, timeout=30)

    redis_client.script_flush()
    created, status = run(main)
    assert status.state == "completed" and status.run_id == created


def test_a_silent_redis_does_not_block_the_loop_and_ends_unavailable(
    silent_server: SilentServer,
) -> None:
    """Redis accepts the connection and never answers: while get_run waits, the heartbeat
    keeps ticking; at the socket timeout the call is StoreUnavailableError."""
    url = f"redis://127.0.0.1:{silent_server.port}/0"
    settings = dataclasses.replace(Settings.from_env(), redis_options={"socket_timeout": 1.0})

    async def main() -> tuple[Any, int]:
        async with AsyncClient(f"redis://127.0.0.1:{closed_port()}/0", url, settings=settings) as c:
            return await ticking(c.get_run("some-run"))

    answer, ticks = run(main)
    assert isinstance(answer, StoreUnavailableError)
    assert ticks >= 10  # the loop ran while the call was pending


def test_redis_down_is_store_unavailable_for_every_call() -> None:
    """Nothing listens on the Redis port: each call is StoreUnavailableError (retryable)."""
    url = f"redis://127.0.0.1:{closed_port()}/0"

    async def main() -> list[Any]:
        async with AsyncClient(url, url) as client:
            calls = [
                client.enqueue_run("patient", "Hi."),
                client.get_run("r1"),
                client.list_runs(),
                client.approve("r1", "1:0", args_hash="0" * 64, by="ops@acme"),
                client.deny("r1", "1:0", "no", args_hash="0" * 64, by="ops@acme"),
                client.abort_run("r1"),
                client.wait_run("r1", timeout=1),
            ]
            return [(await ticking(call))[0] for call in calls]

    answers = run(main)
    assert all(isinstance(a, StoreUnavailableError) for a in answers), answers
    assert all(a.retryable for a in answers)


def test_redis_down_is_store_unavailable_for_every_call_of_the_sync_client_too() -> None:
    """The sync client answers a Redis that is away as the asyncio one does: retryable."""
    url = f"redis://127.0.0.1:{closed_port()}/0"
    client = Client(url, url)
    calls: list[Callable[[], Any]] = [
        lambda: client.enqueue_run("patient", "Hi."),
        lambda: client.get_run("r1"),
        lambda: client.list_runs(),
        lambda: client.approve("r1", "1:0", args_hash="0" * 64, by="ops@acme"),
        lambda: client.deny("r1", "1:0", "no", args_hash="0" * 64, by="ops@acme"),
        lambda: client.abort_run("r1"),
    ]
    answers: list[Any] = []
    for call in calls:
        try:
            answers.append(call())
        except Exception as exc:
            answers.append(exc)
    assert all(isinstance(a, StoreUnavailableError) for a in answers), answers
    assert all(a.retryable for a in answers)


def test_a_silent_broker_is_message_not_sent_with_the_run_id_and_the_retry_converges(
    hosted: str, silent_server: SilentServer
) -> None:
    """The broker accepts and never answers: enqueue_run waits on its publish thread while
    the heartbeat ticks, then raises MessageNotSentError naming the run (created in Redis);
    enqueue_run again with that id, on a working broker, sends turn 1 and the run completes."""
    broker = f"redis://127.0.0.1:{silent_server.port}/0"
    run_id = f"silent-{uuid.uuid4().hex[:8]}"

    async def main() -> tuple[Any, int, str, Any]:
        async with AsyncClient(broker, hosted, publish_timeout=1.0) as stuck:
            refused, ticks = await ticking(stuck.enqueue_run("patient", "Hi.", run_id=run_id))
            state = (await stuck.get_run(run_id)).state
        async with AsyncClient(redis_url=hosted) as working:
            again = await working.enqueue_run("patient", "Hi.", run_id=run_id)
            return refused, ticks, state, (again, await working.wait_run(again, timeout=30))

    refused, ticks, state, (again, status) = run(main)
    assert isinstance(refused, MessageNotSentError) and run_id in str(refused)
    assert (refused.run_id, refused.applied, refused.pending) == (run_id, "created", "turn 1")
    assert ticks >= 10  # the loop ran while the publish was pending
    assert state == "running"
    assert again == run_id and status.state == "completed"


def test_a_broker_that_refuses_the_decision_and_the_unwind_is_message_not_sent(
    hosted: str,
) -> None:
    """The decision and the abort are recorded; the broker being down is MessageNotSentError
    naming the run, as the sync client says it (the reaper sends them at the deadline)."""
    dead = f"redis://127.0.0.1:{closed_port()}/0"

    async def main() -> tuple[Any, Any]:
        async with AsyncClient(redis_url=hosted) as working:
            run_id = await working.enqueue_run("approver", "Tell Ada.")
            pending = None
            for _ in range(400):
                status = await working.get_run(run_id)
                if status.awaiting_approval:
                    pending = status.pending_approvals[0]
                    break
                await asyncio.sleep(0.05)
            assert pending is not None
            other = await working.enqueue_run("approver", "Tell Ada.")
        async with AsyncClient(dead, hosted, publish_timeout=5.0) as broken:
            decided, _ = await ticking(
                broken.approve(run_id, "1:0", args_hash=pending["args_hash"], by="ops@acme")
            )
            aborted, _ = await ticking(broken.abort_run(other))
        async with AsyncClient(redis_url=hosted) as working:
            await working.abort_run(run_id, "cleaning up")
        return (decided, run_id), (aborted, other)

    (decided, first), (aborted, second) = run(main)
    assert isinstance(decided, MessageNotSentError) and first in str(decided)
    assert (decided.applied, decided.pending) == ("call 1:0 approved", "turn")
    assert isinstance(aborted, MessageNotSentError) and second in str(aborted)
    assert (aborted.applied, aborted.pending) == ("aborted", "unwind")


@pytest.mark.parametrize(
    "options",
    [
        {"publish_threads": 0},
        {"publish_threads": 2.5},
        {"publish_timeout": 0},
        {"publish_timeout": float("nan")},
    ],
)
def test_a_publish_bound_that_is_not_positive_is_refused(options: dict[str, Any]) -> None:
    with pytest.raises(ConfigurationError, match="publish_"):
        AsyncClient("redis://127.0.0.1:1/0", "redis://127.0.0.1:1/0", **options)


def test_the_web_app_answers_other_requests_while_one_waits_on_a_silent_broker(
    hosted: str, silent_server: SilentServer
) -> None:
    """One request's publish hangs on a broker that never answers; requests for a run's
    status are answered while it is still pending; once the broker goes away for good, it
    answers 409 MessageNotSentError naming its run."""
    broker = f"redis://127.0.0.1:{silent_server.port}/0"

    async def main() -> tuple[bool, list[int], Any]:
        async with AsyncClient(redis_url=hosted) as working:
            known = await working.enqueue_run("patient", "Hi.")
        async with (
            AsyncClient(broker, hosted, publish_timeout=60.0) as client,
            http(web_app(client)) as web,
        ):
            starting = asyncio.create_task(
                web.post("/runs", json={"agent": "patient", "input": "Hi."})
            )
            for _ in range(600):  # bounded: 30 s; the publish has reached the broker
                if silent_server.held:
                    break
                await asyncio.sleep(0.05)
            reads = [(await web.get(f"/runs/{known}")).status_code for _ in range(3)]
            pending = not starting.done()
            silent_server.release()
            started = await starting
        return pending, reads, started.json()

    pending, reads, started = run(main)
    assert pending and reads == [200, 200, 200]
    assert started["error"] == "MessageNotSentError" and "created, but" in started["detail"]
