"""A step's task message, prepared once per task and pushed to its queue with one command.

Celery's ``send_task`` costs a dispatching caller about half a millisecond per step in Python
(the router, the message's headers built anew, the producer pool, kombu's publish and its
retry wrapper), which was a third of a caller's CPU per run. Yet for one task every message of
a step differs in five values only: the task id (``<run>:<step>``), the keyword arguments, what
Flower shows of them, the caller thread's reply-to and kombu's delivery tag.

So the message of each task is made once by Celery itself, through ``send_task`` with a
producer whose channel captures what kombu would push instead of pushing it, with a marker in
each of those five places. What comes between the markers is kept, and each later message is
those pieces with the call's values between them, pushed with ``LPUSH`` to the key kombu would
have pushed it to: the same bytes Celery would have sent, but for the delivery tag, a fresh
UUID either way (``tests/integration/test_prepared_publish.py`` compares the two).

It serves only where nothing can tell the difference, and Celery's publish serves the rest:

- the broker is Redis on saga's transport (``saga.transport``), at the store's very URL, so
  that the store's client reaches the queue (a RabbitMQ broker, a Sentinel one, a broker on a
  Redis of its own use Celery's publish), with no global key prefix;
- the task's queue needs no declaration (``saga.transport.declares_nothing``) and no expiry;
- nothing listens to Celery's publish signals (``before_task_publish``,
  ``after_task_publish``: OpenTelemetry's instrumentation, a user's own) and Celery sends no
  ``task-sent`` event (``task_send_sent_event``);
- no worker task is current (a task's publish carries its parent's ids) and nobody replaced
  the app's ``send_task`` (a test observing the publishes);
- the message Celery made is the shape this module knows: protocol 2, JSON, no compression,
  a base64 body, no time in it (no ``eta`` or ``expires``), the markers where expected, and
  rebuilt from its pieces, it is the message Celery made, byte for byte.

A push that fails raises as Celery's publish does (``kombu.exceptions.OperationalError``), after
the retries the store's client makes on a lost connection.
"""

from __future__ import annotations

import base64
import logging
import os
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from json.encoder import encode_basestring_ascii
from typing import Any
from urllib.parse import parse_qs, urlparse

import redis
from celery import Celery
from celery.signals import after_task_publish, before_task_publish
from kombu import serialization
from kombu.exceptions import OperationalError
from kombu.utils import json as kombu_json
from kombu.utils.uuid import uuid

from saga.transport import ALIASES, Channel, Transport, declares_nothing

__all__ = ["PreparedPublisher"]

logger = logging.getLogger("saga")

#: kombu's JSON, as its Redis transport writes a message and its serializer a body (untyped).
_json_dumps: Callable[[Any], str] = kombu_json.dumps
_json_loads: Callable[[str], Any] = kombu_json.loads
_serialize: Callable[..., tuple[str, str, str | bytes]] = serialization.dumps


def _escape(value: str) -> str:
    """A string as kombu's JSON writes it, without its quotes (its encoder is the standard
    one with ``ensure_ascii``; ``_escapes_as_kombu`` checks that)."""
    return encode_basestring_ascii(value)[1:-1]


#: The five places of a message that differ between two steps of one task.
_SLOTS = ("body", "task_id", "kwargsrepr", "reply_to", "delivery_tag")


@dataclass(frozen=True)
class _Template:
    """One task's message as Celery made it, cut at the five places a call fills."""

    queue: str
    #: The message as a format string: ``{0}`` .. ``{4}`` are the slots of ``_SLOTS``.
    text: str
    #: The body's third element (callbacks, errbacks, chain, chord), as Celery set it.
    embed: dict[str, Any]
    serializer: str


class _CapturingChannel(Channel):
    """A channel that keeps the message kombu would push, and the key, instead of pushing."""

    captured: tuple[str, dict[str, Any]] | None = None

    def _put(self, queue: str, message: dict[str, Any], **kwargs: Any) -> None:
        if self.global_keyprefix or (self._expires and queue in self._expires):
            raise _NotPreparable("the queue's key is prefixed, or the queue expires")
        priority = self._get_message_priority(message, reverse=False)  # type: ignore[no-untyped-call]
        self.captured = (self._q_for_pri(queue, priority), message)  # type: ignore[no-untyped-call]


class _CapturingTransport(Transport):
    Channel = _CapturingChannel


class _NotPreparable(Exception):
    """The message Celery made is not one this module can prepare."""


class PreparedPublisher:
    """Pushes a step's message of a task prepared once (see the module), where it may.

    ``client``: the store's Redis client, which reaches the broker's queues when the broker
    is at the store's URL. ``send_options(task)``: what the dispatcher passes ``send_task``
    besides the call's own values (its ``declare`` among them)."""

    def __init__(
        self,
        app: Celery,
        store_url: str,
        client: Callable[[], redis.Redis],
        send_options: Callable[[str], dict[str, Any]],
    ) -> None:
        self.app = app
        self._client = client
        self._send_options = send_options
        self._same_redis = _broker_is_store(app, store_url)
        #: Per task name: its template, or None where Celery's publish serves it.
        self._templates: dict[str, _Template | None] = {}
        self._pid = os.getpid()
        self._lock = threading.Lock()

    def publish(self, task: str, task_id: str, kwargs: dict[str, Any], kwargsrepr: str) -> bool:
        """Push the message Celery would send for this call; False (nothing sent) where
        Celery's publish must send it."""
        prepared = self.message(task, task_id, kwargs, kwargsrepr)
        if prepared is None:
            return False
        queue, message = prepared
        try:
            self._client().lpush(queue, message)
        except redis.RedisError as exc:
            raise OperationalError(str(exc)) from exc  # as Celery's publish raises it
        return True

    def message(
        self, task: str, task_id: str, kwargs: dict[str, Any], kwargsrepr: str
    ) -> tuple[str, str] | None:
        """The queue's key and the message Celery would push for this call, to push on the
        store's connection (``publish``, or the step's reservation itself); None where
        Celery's publish must send it."""
        if not self._same_redis or not self._nothing_listens():
            return None
        template = self._template(task)
        if template is None:
            return None
        body = _body(template, kwargs)
        return template.queue, _fill(
            template, body, task_id, kwargsrepr, self.app.thread_oid, uuid()
        )

    def _nothing_listens(self) -> bool:
        conf = self.app.conf
        return not (
            before_task_publish.receivers
            or after_task_publish.receivers
            or conf.task_send_sent_event
            or "send_task" in vars(self.app)
            or self.app.current_worker_task is not None
        )

    def _template(self, task: str) -> _Template | None:
        if os.getpid() != self._pid:  # forked: a message names its sender's process
            self._templates, self._lock, self._pid = {}, threading.Lock(), os.getpid()
        if task in self._templates:
            return self._templates[task]
        with self._lock:
            if task not in self._templates:
                try:
                    self._templates[task] = self._prepare(task)
                except _NotPreparable as exc:
                    logger.info("%s: published through Celery (%s)", task, exc)
                    self._templates[task] = None
                except Exception as exc:
                    # The broker away, say: not kept. This call goes through Celery's publish,
                    # which retries and raises as it always does; the next one prepares again.
                    logger.debug("%s: not prepared this time (%r)", task, exc)
                    return None
        return self._templates[task]

    def _prepare(self, task: str) -> _Template:
        """The task's message, made by Celery with markers in place of the call's values."""
        if not declares_nothing(self.app, task):
            raise _NotPreparable("its queue is declared on publish")
        conf = self.app.conf
        if conf.task_protocol != 2 or conf.task_compression:
            raise _NotPreparable("not task protocol 2, or compressed")
        marker = uuid().replace("-", "")
        markers = [f"saga-{slot}-{marker}" for slot in _SLOTS]
        kwargs = {"run_id": f"saga-run-{marker}", "step": 0, "args": {}}
        with (
            self.app.connection_for_write(transport=_CapturingTransport) as connection,
            connection.channel() as channel,
        ):
            producer = self.app.amqp.Producer(channel, auto_declare=False)
            self.app.send_task(
                task,
                kwargs=kwargs,
                task_id=markers[1],
                reply_to=markers[3],
                producer=producer,
                ignore_result=True,
                argsrepr="()",
                kwargsrepr=markers[2],
                add_to_parent=False,
                **self._send_options(task),
            )
            if channel.captured is None:
                raise _NotPreparable("Celery pushed nothing")
            queue, message = channel.captured
        return _template_of(queue, message, kwargs, marker, markers)


def _template_of(
    queue: str,
    message: dict[str, Any],
    kwargs: dict[str, Any],
    marker: str,
    markers: Sequence[str],
) -> _Template:
    """Cut the captured message at the markers, and check it is rebuilt byte for byte."""
    headers, properties = message.get("headers") or {}, message.get("properties") or {}
    if (
        message.get("content-type") != "application/json"
        or message.get("content-encoding") != "utf-8"
        or properties.get("body_encoding") != "base64"
        or headers.get("eta") is not None
        or headers.get("expires") is not None
        or "compression" in headers
        or "expiration" in properties
    ):
        raise _NotPreparable("not a JSON message with a base64 body and no time in it")
    body = base64.b64decode(message["body"]).decode("utf-8")
    decoded = _json_loads(body)
    if not (isinstance(decoded, list) and len(decoded) == 3 and decoded[:2] == [[], kwargs]):
        raise _NotPreparable("its body is not (args, kwargs, embed)")
    pristine = _json_dumps(message)
    cut = {**message, "body": markers[0], "properties": {**properties}}
    tag = cut["properties"]["delivery_tag"]
    cut["properties"]["delivery_tag"] = markers[4]
    # A format string: the text's own braces doubled, each marker (plain hex, no braces) its
    # slot's field.
    text = _json_dumps(cut).replace("{", "{{").replace("}", "}}")
    for index, mark in enumerate(markers):
        text = text.replace(mark, f"{{{index}}}")
    if marker in text:
        raise _NotPreparable("a marker in an unexpected place")
    template = _Template(queue, text, decoded[2], "json")
    rebuilt = _fill(template, _body(template, kwargs), markers[1], markers[2], markers[3], tag)
    if rebuilt != pristine or body != _serialized(template, kwargs) or not _escapes_as_kombu():
        raise _NotPreparable("rebuilt from its pieces, it is not the message Celery made")
    return template


def _serialized(template: _Template, kwargs: dict[str, Any]) -> str:
    _content_type, encoding, data = _serialize(
        ((), kwargs, template.embed), serializer=template.serializer
    )
    return data if isinstance(data, str) else data.decode(encoding)


def _body(template: _Template, kwargs: dict[str, Any]) -> str:
    return base64.b64encode(_serialized(template, kwargs).encode("utf-8")).decode("ascii")


def _fill(
    template: _Template, body: str, task_id: str, kwargsrepr: str, reply_to: str, tag: str
) -> str:
    """The template with the call's values, each escaped as kombu's JSON escapes a string
    (``_escape``; the body is base64, which needs none)."""
    return template.text.format(
        body, _escape(task_id), _escape(kwargsrepr), _escape(reply_to), _escape(tag)
    )


def _escapes_as_kombu() -> bool:
    """Whether ``_escape`` is kombu's JSON for a string, on what needs escaping."""
    probe = 'a "quoted" \\ caf\u00e9 \u2603 \n\t\x00 \ud83d\ude00 {}'
    return _escape(probe) == _json_dumps(probe)[1:-1]


def _broker_is_store(app: Celery, store_url: str) -> bool:
    """Whether the broker is a Redis at the store's very server and database, on saga's
    transport (the URLs' client options, a ``client_name`` or a pool's size, may differ)."""
    conf = app.conf
    url = conf.get("broker_write_url") or conf.get("broker_url") or ""
    return (
        isinstance(url, str)
        and _database_of(url) == _database_of(store_url)
        and urlparse(url).scheme in ALIASES
        and conf.get("broker_transport") in ALIASES.values()
        and not (conf.get("broker_transport_options") or {}).get("global_keyprefix")
    )


def _database_of(url: str) -> tuple[str, str, str]:
    """A Redis URL's scheme, server (with its login) and database."""
    parts = urlparse(url)
    database = parts.path.strip("/") or parse_qs(parts.query).get("db", ["0"])[0]
    return parts.scheme, parts.netloc, database
