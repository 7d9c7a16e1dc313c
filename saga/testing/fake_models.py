"""A scripted model that answers over HTTP in the wire formats saga speaks, so tests (and the
docs' examples) run the real SDKs with no key and no network.

One handler answers OpenAI Chat Completions (``/chat/completions``), OpenAI Responses
(``/responses``) and Anthropic Messages (``/messages``). It reaches the SDK two ways:

- in this process, through the SDK's own mock transport: build the client with
  ``http_client=model.http_client()``, which is ``httpx.Client(transport=
  httpx.MockTransport(model.handle))`` (openai 3.x and anthropic 2.x are built on ``httpx2``,
  earlier versions on ``httpx``: the one installed is used);
- from other processes (a worker running a hosted agent's turns): ``with model.serve() as
  url`` answers on a loopback port; point ``OPENAI_BASE_URL`` at ``url + "/v1"`` and
  ``ANTHROPIC_BASE_URL`` at ``url`` (``model.environ(url)``) and the SDK clients the app
  builds itself talk to it.

The answer to a request is the script's step numbered by how many answers of the model the
request already carries, as ``ScriptedPolicy`` does: a redelivered turn or a second worker
gets the same answer for the same conversation. Unless ``play(script, replays={i: step})``
says otherwise: then a second ask for step ``i`` (a turn asked again after its first answer
was lost, ``saga drill``'s ``model_differs_on_replay``) gets ``step``, as a real model, asked
the same thing twice, may answer differently. The model counts asks since ``play``: it
serves one conversation at a time that way.
"""

from __future__ import annotations

import contextlib
import json
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, TypeAlias

try:  # the SDKs' own HTTP library: httpx2 from openai 3.x / anthropic 2.x, httpx before
    import httpx2 as httpx
except ImportError:  # pragma: no cover - depends on the installed SDK
    import httpx  # type: ignore[no-redef,import-not-found,unused-ignore]

#: Placeholders the SDKs insist on; nothing checks them.
FAKE_KEY = "sk-fake-key-for-tests"


@dataclass(frozen=True)
class ModelFailure:
    """A script step that answers with an HTTP error instead (429 and 5xx are retried by the
    hosted loop, honouring ``retry_after``; others end the run)."""

    status: int
    message: str = "injected model failure"
    retry_after: float | None = None


#: One answer: a final text; one ``(tool, arguments)`` call or a list of them (parallel
#: calls); a ``ModelFailure``; or a function of the request's JSON body returning one of those.
Step: TypeAlias = (
    str
    | ModelFailure
    | tuple[str, dict[str, Any]]
    | Sequence[tuple[str, dict[str, Any]]]
    | Callable[[dict[str, Any]], Any]
)


@dataclass(frozen=True)
class Answered:
    """What the model answered one request: the script step's position, whether it was a
    second (or later) ask for that step, and the calls or text it gave (``failed``: an HTTP
    error instead)."""

    index: int
    again: bool
    calls: tuple[tuple[str, dict[str, Any]], ...] = ()
    text: str = ""
    failed: bool = False


class FakeModel:
    """A model that plays ``script``; ``requests`` keeps every request body it answered (in
    this process, whichever process sent it) and ``answered`` what it said to each,
    ``usage`` is reported on every answer."""

    def __init__(self, script: Sequence[Step] = (), *, usage: tuple[int, int] = (12, 7)) -> None:
        self.script: list[Step] = list(script)
        self.replays: dict[int, Step] = {}
        self.usage = usage
        self.requests: list[dict[str, Any]] = []
        self.answered: list[Answered] = []
        self._asked: dict[int, int] = {}
        #: Where ``serve()`` answers, while it does.
        self.url = ""
        self._lock = threading.Lock()

    def play(self, script: Sequence[Step], *, replays: Mapping[int, Step] | None = None) -> None:
        """Start over with another script (the served port stays the same); ``replays[i]``
        answers a second ask for step ``i`` (0-based: the ask carrying ``i`` answers)."""
        with self._lock:
            self.script = list(script)
            self.replays = dict(replays or {})
            self.requests.clear()
            self.answered.clear()
            self._asked.clear()

    def asks(self, index: int) -> list[Answered]:
        """What the model answered each ask for step ``index`` since ``play``, in order."""
        with self._lock:
            return [a for a in self.answered if a.index == index]

    # -- the handler ---------------------------------------------------------------------------

    def handle(self, request: httpx.Request) -> httpx.Response:
        """Answer one SDK request (``httpx.MockTransport``'s handler)."""
        path = request.url.path
        fmt = next((f for suffix, f in _ROUTES if path.endswith(suffix)), None)
        if fmt is None or request.method != "POST":
            return httpx.Response(404, json={"error": {"message": f"no fake route {path}"}})
        body = json.loads(request.content or b"{}")
        with self._lock:
            self.requests.append(body)
            index = _answers_in(fmt, body)
            again = self._asked.get(index, 0) > 0
            self._asked[index] = self._asked.get(index, 0) + 1
            script = list(self.script)
            replay = self.replays.get(index) if again else None
        if index >= len(script):
            message = f"the fake model's script has {len(script)} answer(s); #{index + 1} asked"
            self._log(Answered(index, again, failed=True))
            return httpx.Response(400, json={"error": {"message": message, "type": "script"}})
        step = script[index] if replay is None else replay
        if callable(step):
            step = step(body)
        if isinstance(step, ModelFailure):
            self._log(Answered(index, again, failed=True))
            headers = {} if step.retry_after is None else {"retry-after": str(step.retry_after)}
            error = {"type": "error", "error": {"message": step.message, "type": "fake"}}
            return httpx.Response(step.status, json=error, headers=headers)
        calls = calls_of(step)
        text = step if isinstance(step, str) else ""
        self._log(Answered(index, again, tuple(calls), text))
        model = str(body.get("model") or "fake-model")
        answer = _RENDER[fmt](index, model, text, calls, self.usage)
        return httpx.Response(200, json=answer)

    def _log(self, answered: Answered) -> None:
        with self._lock:
            self.answered.append(answered)

    def transport(self) -> httpx.MockTransport:
        return httpx.MockTransport(self.handle)

    def http_client(self) -> httpx.Client:
        """What to pass as the SDK client's ``http_client``."""
        return httpx.Client(transport=self.transport())

    # -- served, for other processes ---------------------------------------------------------

    @contextlib.contextmanager
    def serve(self) -> Iterator[str]:
        """Answer on ``http://127.0.0.1:<free port>`` until the block ends; yields that URL."""
        server = ThreadingHTTPServer(("127.0.0.1", 0), _handler_for(self))
        server.daemon_threads = True
        thread = threading.Thread(target=server.serve_forever, name="fake-model", daemon=True)
        thread.start()
        self.url = f"http://127.0.0.1:{server.server_address[1]}"
        try:
            yield self.url
        finally:
            self.url = ""
            server.shutdown()
            server.server_close()
            thread.join(10)

    @staticmethod
    def environ(url: str) -> dict[str, str]:
        """The variables that point the SDKs' default clients at a served fake model."""
        return {
            "OPENAI_BASE_URL": f"{url}/v1",
            "OPENAI_API_KEY": FAKE_KEY,
            "ANTHROPIC_BASE_URL": url,
            "ANTHROPIC_API_KEY": FAKE_KEY,
            # The Agents SDK would send its traces to OpenAI with the fake key.
            "OPENAI_AGENTS_DISABLE_TRACING": "1",
        }


def _handler_for(model: FakeModel) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            length = int(self.headers.get("content-length") or 0)
            request = httpx.Request(
                "POST", f"http://fake-model{self.path}", content=self.rfile.read(length)
            )
            response = model.handle(request)
            self.send_response(response.status_code)
            for name, value in response.headers.items():
                if name.lower() not in ("content-length", "transfer-encoding", "connection"):
                    self.send_header(name, value)
            self.send_header("content-length", str(len(response.content)))
            self.end_headers()
            self.wfile.write(response.content)

        def log_message(self, format: str, *args: Any) -> None:
            pass  # quiet: the test's output is the test's

    return Handler


# -- the three formats ---------------------------------------------------------------------------


def calls_of(step: Any) -> list[tuple[str, dict[str, Any]]]:
    """The calls a script step answers with (none for a final text)."""
    if isinstance(step, str):
        return []
    if isinstance(step, tuple) and len(step) == 2 and isinstance(step[0], str):
        return [(step[0], dict(step[1]))]
    calls = [(str(name), dict(args)) for name, args in step]
    if not calls:
        raise ValueError("a script step holds no calls; use a string for a final answer")
    return calls


def _answers_in(fmt: str, body: dict[str, Any]) -> int:
    """How many answers of the model the conversation already holds."""
    if fmt == "responses":
        answers, in_answer = 0, False
        for item in body.get("input") or []:
            mine = isinstance(item, dict) and (
                item.get("type") in ("function_call", "reasoning")
                or item.get("role") == "assistant"
            )
            answers += mine and not in_answer
            in_answer = mine
        return answers
    return sum(1 for m in body.get("messages") or [] if m.get("role") == "assistant")


def _chat(
    n: int, model: str, text: str, calls: list[tuple[str, dict[str, Any]]], usage: tuple[int, int]
) -> dict[str, Any]:
    tool_calls = [
        {
            "id": f"call_{n}_{i}",
            "type": "function",
            "function": {"name": name, "arguments": json.dumps(args)},
        }
        for i, (name, args) in enumerate(calls)
    ]
    message: dict[str, Any] = {"role": "assistant", "content": text or None}
    if tool_calls:
        message["tool_calls"] = tool_calls
    return {
        "id": f"chatcmpl-fake-{n}",
        "object": "chat.completion",
        "created": 0,
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": message,
                "finish_reason": "tool_calls" if calls else "stop",
                "logprobs": None,
            }
        ],
        "usage": {
            "prompt_tokens": usage[0],
            "completion_tokens": usage[1],
            "total_tokens": sum(usage),
        },
    }


def _responses(
    n: int, model: str, text: str, calls: list[tuple[str, dict[str, Any]]], usage: tuple[int, int]
) -> dict[str, Any]:
    output: list[dict[str, Any]] = [
        {
            "type": "function_call",
            "id": f"fc_{n}_{i}",
            "call_id": f"call_{n}_{i}",
            "name": name,
            "arguments": json.dumps(args),
            "status": "completed",
        }
        for i, (name, args) in enumerate(calls)
    ]
    if not calls:
        content = [{"type": "output_text", "text": text, "annotations": []}]
        output.append(
            {
                "type": "message",
                "id": f"msg_{n}",
                "role": "assistant",
                "status": "completed",
                "content": content,
            }
        )
    return {
        "id": f"resp_fake_{n}",
        "object": "response",
        "created_at": 0,
        "model": model,
        "status": "completed",
        "output": output,
        "parallel_tool_calls": True,
        "tool_choice": "auto",
        "tools": [],
        "error": None,
        "incomplete_details": None,
        "usage": {
            "input_tokens": usage[0],
            "output_tokens": usage[1],
            "total_tokens": sum(usage),
            "input_tokens_details": {"cached_tokens": 0},
            "output_tokens_details": {"reasoning_tokens": 0},
        },
    }


def _anthropic(
    n: int, model: str, text: str, calls: list[tuple[str, dict[str, Any]]], usage: tuple[int, int]
) -> dict[str, Any]:
    content: list[dict[str, Any]] = [
        {"type": "tool_use", "id": f"toolu_{n}_{i}", "name": name, "input": args}
        for i, (name, args) in enumerate(calls)
    ]
    if not calls:
        content.append({"type": "text", "text": text})
    return {
        "id": f"msg_fake_{n}",
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content,
        "stop_reason": "tool_use" if calls else "end_turn",
        "stop_sequence": None,
        "usage": {"input_tokens": usage[0], "output_tokens": usage[1]},
    }


_ROUTES = (("/chat/completions", "chat"), ("/responses", "responses"), ("/messages", "anthropic"))
_RENDER = {"chat": _chat, "responses": _responses, "anthropic": _anthropic}
