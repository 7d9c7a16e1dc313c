"""A model provider in-process: the real SDK clients, over a mock HTTP transport that answers
with recorded-style exchanges (``tests/fixtures/models/<format>/<name>.json``) and keeps every
request the SDK sent, so the tests can assert the exact bodies.
"""

from __future__ import annotations

import importlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

from saga.agents import ModelFormat
from tests.conftest import service_missing

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "models"


def exchange(fmt: ModelFormat | str, name: str) -> dict[str, Any]:
    """A recorded exchange: ``{"status", "headers", "body"}`` as the provider answered."""
    loaded: dict[str, Any] = json.loads((FIXTURES / str(fmt) / f"{name}.json").read_text())
    return loaded


def body(fmt: ModelFormat | str, name: str) -> dict[str, Any]:
    """The response body of a recorded exchange."""
    answer: dict[str, Any] = exchange(fmt, name)["body"]
    return answer


def sdk(name: str) -> ModuleType:
    """An SDK module; its tests skip without it locally and fail in CI (``dev`` installs it)."""
    try:
        return importlib.import_module(name)
    except ImportError:
        service_missing(f"the {name} SDK is not installed; `pip install -e '.[dev]'`")
        raise


def http_module(sdk_module: ModuleType) -> ModuleType:
    """The HTTP library the SDK is built on (``httpx``, or ``httpx2`` in newer releases),
    found from its default client class so the mock transport matches whichever it is."""
    for base in sdk_module.DefaultHttpxClient.__mro__:
        if base.__name__ == "Client" and base.__module__.split(".")[0].startswith("httpx"):
            return importlib.import_module(base.__module__.split(".")[0])
    raise RuntimeError(f"cannot tell which HTTP library {sdk_module.__name__} uses")


@dataclass
class Seen:
    """One request as the SDK sent it."""

    method: str
    path: str
    headers: dict[str, str]
    body: dict[str, Any]


@dataclass
class ModelServer:
    """Answers each request with the next queued exchange (or raises a queued exception)."""

    http: ModuleType
    answers: list[dict[str, Any] | BaseException] = field(default_factory=list)
    seen: list[Seen] = field(default_factory=list)

    def queue(self, *answers: dict[str, Any] | BaseException) -> ModelServer:
        self.answers.extend(answers)
        return self

    def handler(self, request: Any) -> Any:
        content = request.content
        self.seen.append(
            Seen(
                request.method,
                request.url.path,
                {k.lower(): v for k, v in request.headers.items()},
                json.loads(content) if content else {},
            )
        )
        if not self.answers:
            raise AssertionError(f"unexpected request {request.method} {request.url.path}")
        answer = self.answers.pop(0)
        if isinstance(answer, BaseException):
            raise answer
        return self.http.Response(answer["status"], headers=answer["headers"], json=answer["body"])

    @property
    def bodies(self) -> list[dict[str, Any]]:
        return [s.body for s in self.seen]


def make_client(fmt: ModelFormat, server: ModelServer) -> Any:
    """The real SDK client for ``fmt``, talking to ``server``, with the SDK's retries off."""
    transport = server.http.MockTransport(server.handler)
    http_client = server.http.Client(transport=transport)
    if fmt is ModelFormat.ANTHROPIC:
        return sdk("anthropic").Anthropic(
            api_key="test", base_url="http://test", http_client=http_client, max_retries=0
        )
    return sdk("openai").OpenAI(
        api_key="test", base_url="http://test/v1", http_client=http_client, max_retries=0
    )


def sdk_name(fmt: ModelFormat) -> str:
    return "anthropic" if fmt is ModelFormat.ANTHROPIC else "openai"
