"""A webhook receiver for tests, in-process on a free port: it checks every signature, answers
as each run's script says (HTTP statuses in order, then 200), and keeps what it got; plus the
callable sink a test worker is configured with (``record``), which keeps what it got in Redis.
"""

from __future__ import annotations

import json
import os
import threading
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import redis

from saga.errors import SignatureError
from saga.notifications import NOTICE_ID_HEADER, SIGNATURE_HEADER, verify
from saga.redis_urls import redis_client

SECRET = "test-secret-0123456789abcdef"
CALLABLE = "tests.integration.notify_receiver:record"
CALLED_KEY = "test:notify:called"


def record(body: dict[str, Any]) -> None:
    """The callable sink: keep the body where the test can read it."""
    client = redis_client(os.environ["SAGA_REDIS_URL"])
    try:
        client.rpush(CALLED_KEY, json.dumps(body))
    finally:
        client.close()


def called(client: redis.Redis, notice_id: str) -> list[dict[str, Any]]:
    bodies = [json.loads(raw) for raw in client.lrange(CALLED_KEY, 0, -1)]
    return [body for body in bodies if body["id"] == notice_id]


@dataclass(frozen=True)
class Received:
    notice_id: str
    attempt: str
    body: dict[str, Any]
    verified: bool
    answered: int


class Receiver:
    def __init__(self) -> None:
        self.received: list[Received] = []
        self._scripts: dict[str, list[int]] = {}
        self._always: dict[str, int] = {}
        self._lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                raw = self.rfile.read(int(self.headers.get("Content-Length", "0")))
                try:
                    verify(raw, self.headers.get(SIGNATURE_HEADER), SECRET)
                    verified = True
                except SignatureError:
                    verified = False
                body = json.loads(raw)
                status = receiver._answer(body.get("run_id", ""))
                with receiver._lock:
                    receiver.received.append(
                        Received(
                            self.headers.get(NOTICE_ID_HEADER, ""),
                            self.headers.get("Saga-Delivery-Attempt", ""),
                            body,
                            verified,
                            status,
                        )
                    )
                self.send_response(status)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}/hooks/saga"

    def script(self, run_id: str, statuses: list[int]) -> None:
        """Answer the notices of ``run_id`` with these statuses first, then 200."""
        with self._lock:
            self._scripts[run_id] = list(statuses)

    def always(self, run_id: str, status: int) -> None:
        with self._lock:
            self._always[run_id] = status

    def _answer(self, run_id: str) -> int:
        with self._lock:
            if run_id in self._always:
                return self._always[run_id]
            script = self._scripts.get(run_id) or []
            return script.pop(0) if script else 200

    def of(self, notice_id: str) -> list[Received]:
        with self._lock:
            return [r for r in self.received if r.notice_id == notice_id]

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(10)
