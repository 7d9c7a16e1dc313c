"""A policy backed by a real model, through the SDK client the user passes in.

saga never constructs a client and never imports an SDK: it calls ``chat.completions.create``,
``responses.create`` or ``messages.create`` on whatever object it is given. Build the client
with ``max_retries=0`` so saga owns the retries: a failed call becomes a ``ModelCallError``
saying whether to retry and after how long, and the hosted loop decides, instead of a client
sleeping inside a Celery task.

Every process that imports the agent's module builds what the module builds, the tools workers
and the web app too, though only the turn worker asks the model. ``ChatModelPolicy.lazy(make)``
calls ``make()`` on the first model call instead, in the process that plays the turn: only it
needs the API key.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

from saga.agents.formats import wire_format
from saga.agents.messages import ModelFormat, ModelTurn
from saga.agents.model_errors import model_call_error
from saga.agents.transcript import Transcript
from saga.tools import Tool

#: Anthropic requires a cap on the answer; the OpenAI formats get one only if asked.
DEFAULT_ANTHROPIC_MAX_TOKENS = 4096
#: Request keywords the policy sets itself; passing them as options would silently fight it.
#: (``model``, ``system`` and ``max_tokens`` are parameters, so they cannot arrive as options.)
_OWN_KEYS = frozenset(
    {"messages", "input", "instructions", "tools", "max_completion_tokens", "max_output_tokens"}
)


class ChatModelPolicy:
    """Ask a model for the next turn with the user's SDK client.

    ``fmt`` picks the API: ``"openai_chat"`` (``client.chat.completions.create``),
    ``"openai_responses"`` (``client.responses.create``) or ``"anthropic"``
    (``client.messages.create``). ``request_options`` go to every request as they are
    (``temperature=0``, ``parallel_tool_calls=False``, ...).
    """

    def __init__(
        self,
        client: Any,
        model: str,
        fmt: ModelFormat | str,
        *,
        system: str | None = None,
        max_tokens: int | None = None,
        strict: bool = False,
        **request_options: Any,
    ) -> None:
        clash = sorted(set(request_options) & _OWN_KEYS)
        if clash:
            raise TypeError(f"ChatModelPolicy sets {', '.join(clash)} itself; pass it by name")
        if request_options.get("stream"):
            raise TypeError("ChatModelPolicy needs whole answers; streaming is not supported")
        self._client = client
        self._make_client: Callable[[], Any] | None = None
        self._making = threading.Lock()
        self.model = model
        self.format = wire_format(fmt)
        self.system = system
        self.max_tokens = max_tokens
        self.strict = strict
        self.request_options = request_options

    @classmethod
    def lazy(
        cls,
        make_client: Callable[[], Any],
        model: str,
        fmt: ModelFormat | str,
        **options: Any,
    ) -> ChatModelPolicy:
        """A policy whose SDK client is ``make_client()``, made on the first model call (once
        per process, shared by its threads), so importing the agent's module needs no key.
        ``options``: as ``ChatModelPolicy``'s (``system``, ``max_tokens``, request options)."""
        if not callable(make_client):
            raise TypeError("ChatModelPolicy.lazy needs a function that makes the SDK client")
        policy = cls(None, model, fmt, **options)
        policy._make_client = make_client
        return policy

    @property
    def client(self) -> Any:
        """The SDK client; for a ``lazy`` policy, made now if this process has none yet (a
        factory that raises, a missing key say, raises here, and the next call tries again)."""
        if self._client is None and self._make_client is not None:
            with self._making:
                if self._client is None:
                    self._client = self._make_client()
        return self._client

    def __call__(self, transcript: Transcript, tools: Sequence[Tool]) -> ModelTurn:
        """Send the conversation, parse the answer; a failed call raises ``ModelCallError``."""
        request = self.request(transcript, tools)
        client = self.client  # outside the try: a client that cannot be made is not a model error
        try:
            response = self.format.create(client, request)
        except Exception as exc:
            error = model_call_error(exc)
            if error is None:
                raise
            raise error from exc
        return self.format.parse(response)

    def request(self, transcript: Transcript, tools: Sequence[Tool]) -> dict[str, Any]:
        """The keyword arguments of the next SDK call, without sending it."""
        request: dict[str, Any] = {"model": self.model}
        request.update(transcript.request(self.format.format, self.system))
        definitions = [self.format.tool_definition(t, strict=self.strict) for t in tools]
        if definitions:  # OpenAI refuses an empty tool list
            request["tools"] = definitions
        max_tokens = self.max_tokens
        if max_tokens is None and self.format.format is ModelFormat.ANTHROPIC:
            max_tokens = DEFAULT_ANTHROPIC_MAX_TOKENS
        if max_tokens is not None:
            request[self.format.max_tokens_key] = max_tokens
        request.update(self.request_options)
        return request

    def __repr__(self) -> str:
        return f"ChatModelPolicy({self.model!r}, {self.format.format.value!r})"
