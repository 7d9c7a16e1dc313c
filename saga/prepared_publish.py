"""A task's message, prepared once per task and pushed to its queue with one command: a step's,
and an unwind's.

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

An unwind's chain is prepared the same way (``chain_message``): its first message, carrying the
rest, made once per task through ``Signature.apply_async`` as ``saga.unwind.send_chain`` sends
it, then filled with the call's values, its chain (the body is serialized per call anyway)
and, from inside a worker task, that task's ids as the message's root and parent, which Celery
takes from the task running. ``mark_sent.lua`` pushes it with the mark: the failed step's
worker makes one round trip instead of two, and the chain exists exactly when it is marked.
The rest of the chain, passed on from each undo's task as Celery's tracer passes it on, is made
the same way from the chain that task's message carried, and pushed by the script recording
the undo done (``saga.compensation``).

It serves only where nothing can tell the difference, and Celery's publish serves the rest:

- the broker is Redis on saga's transport (``saga.transport``), at the store's very URL, so
  that the store's client reaches the queue (a RabbitMQ broker, a Sentinel one, a broker on a
  Redis of its own use Celery's publish), with no global key prefix;
- the task's queue needs no declaration (``saga.transport.declares_nothing``) and no expiry;
- nothing listens to Celery's publish signals (``before_task_publish``,
  ``after_task_publish``: OpenTelemetry's instrumentation, a user's own) and Celery sends no
  ``task-sent`` event (``task_send_sent_event``);
- nobody replaced the app's ``send_task`` (a test observing the publishes); a step's message
  is prepared where no worker task is current (a task's publish carries its parent's ids), an
  unwind's anywhere but where Celery would give it the parent's priority
  (``task_inherit_parent_priority``);
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
from celery.canvas import Signature
from celery.signals import after_task_publish, before_task_publish
from celery.utils.saferepr import saferepr
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


#: The places of a message that differ between two of one task's: the five a step's fills,
#: and the worker task's ids an unwind's first message carries from inside one.
_SLOTS = ("body", "task_id", "kwargsrepr", "reply_to", "delivery_tag", "root_id", "parent_id")

#: How a message is made, which the template is of: a step's (``send_task``, no worker task
#: current), an unwind's first from outside a worker task, and from inside one.
_STEP, _CHAIN, _CHAIN_IN_TASK = "step", "chain", "chain in a task"


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
    """Pushes a task's message prepared once per task (see the module), where it may.

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
        #: Per task name and way of making it: its template, or None where Celery's publish
        #: serves it.
        self._templates: dict[tuple[str, str], _Template | None] = {}
        self._pid = os.getpid()
        self._lock = threading.Lock()

    def publish(self, task: str, task_id: str, kwargs: dict[str, Any], kwargsrepr: str) -> bool:
        """Push the message Celery would send for this call; False (nothing sent) where
        Celery's publish must send it."""
        prepared = self.message(task, task_id, kwargs, kwargsrepr)
        if prepared is None:
            return False
        self.push(*prepared)
        return True

    def push(self, queue: str, message: str) -> None:
        """Push a prepared message to its queue; raises as Celery's publish raises."""
        try:
            self._client().lpush(queue, message)
        except redis.RedisError as exc:
            raise OperationalError(str(exc)) from exc

    def message(
        self, task: str, task_id: str, kwargs: dict[str, Any], kwargsrepr: str
    ) -> tuple[str, str] | None:
        """The queue's key and the message Celery would push for this step's call, to push on
        the store's connection (``publish``, or the step's reservation itself); None where
        Celery's publish must send it."""
        if self.app.current_worker_task is not None or not self.may_prepare():
            return None
        template = self._template(task, _STEP, kwargs)
        if template is None:
            return None
        body = _body(template, kwargs, template.embed)
        return template.queue, _fill(
            template, body, task_id, kwargsrepr, self.app.thread_oid, uuid()
        )

    def chain_message(
        self, first: Signature, rest: Sequence[dict[str, Any]]
    ) -> tuple[str, str] | None:
        """The queue's key and the message ``first.apply_async(chain=rest)`` would push here
        (``saga.unwind.send_chain``; Celery's tracer passing the rest of a chain on), for
        ``mark_sent.lua`` or ``push`` to push; None where Celery's publish must send it.
        Once pushed, ``pushed_from_here`` adds it to the running task's trail, as Celery's
        publish does."""
        options = dict(first.options)
        task_id = options.pop("task_id", None)
        parent = self.app.current_worker_task
        try:
            preparable = (
                self.may_prepare()
                and not first.args
                and first.immutable
                and options == self._send_options(first.task)
                and not (parent is not None and self.app.conf.task_inherit_parent_priority)
                and first.task in self.app.tasks
            )
        except Exception:  # the app's tasks could not be finalized, say: Celery's publish decides
            return None
        if not preparable or not isinstance(task_id, str):
            return None
        ids: tuple[str, ...] = ()
        if parent is not None:
            request = parent.request
            ids = (request.root_id or request.id, request.id)
            if not all(isinstance(i, str) and i for i in ids):
                return None
        kwargs = dict(first.kwargs)
        template = self._template(first.task, _CHAIN_IN_TASK if ids else _CHAIN, kwargs)
        if template is None:
            return None
        body = _body(template, kwargs, {**template.embed, "chain": list(rest)})
        kwargsrepr = saferepr(
            kwargs, self.app.amqp.kwargsrepr_maxsize, maxlevels=self.app.conf.task_repr_maxlevels
        )
        return template.queue, _fill(
            template, body, task_id, kwargsrepr, self.app.thread_oid, uuid(), *ids
        )

    def pushed_from_here(self, first: Signature) -> None:
        """What Celery's publish does once the message is sent from inside a task: its
        result joins the task's trail (the children a stored result lists)."""
        parent = self.app.current_worker_task
        if parent is not None:
            result = first.type.AsyncResult(first.options["task_id"])
            result.ignored = first.type.ignore_result
            parent.add_trail(result)

    def may_prepare(self) -> bool:
        """Whether the broker is the store's Redis and nothing could tell a prepared message
        from Celery's publish (see the module)."""
        conf = self.app.conf
        return self._same_redis and not (
            before_task_publish.receivers
            or after_task_publish.receivers
            or conf.task_send_sent_event
            or "send_task" in vars(self.app)
        )

    def _template(self, task: str, way: str, kwargs: dict[str, Any]) -> _Template | None:
        if os.getpid() != self._pid:  # forked: a message names its sender's process
            self._templates, self._lock, self._pid = {}, threading.Lock(), os.getpid()
        key = (task, way)
        if key in self._templates:
            return self._templates[key]
        with self._lock:
            if key not in self._templates:
                try:
                    self._templates[key] = self._prepare(task, way, kwargs)
                except _NotPreparable as exc:
                    logger.info("%s (%s): published through Celery (%s)", task, way, exc)
                    self._templates[key] = None
                except Exception as exc:
                    # The broker away, say: not kept. This call goes through Celery's publish,
                    # which retries and raises as it always does; the next one prepares again.
                    logger.debug("%s (%s): not prepared this time (%r)", task, way, exc)
                    return None
        return self._templates[key]

    def _prepare(self, task: str, way: str, kwargs: dict[str, Any]) -> _Template:
        """The task's message, made by Celery with markers in place of the call's values (the
        keyword arguments are the call's: a task's signature may check them; the body is
        serialized per call)."""
        if not declares_nothing(self.app, task):
            raise _NotPreparable("its queue is declared on publish")
        conf = self.app.conf
        if conf.task_protocol != 2 or conf.task_compression:
            raise _NotPreparable("not task protocol 2, or compressed")
        marker = uuid().replace("-", "")
        markers = [f"saga-{slot}-{marker}" for slot in _SLOTS]
        if way == _STEP:
            kwargs = {"run_id": f"saga-run-{marker}", "step": 0, "args": {}}
        with (
            self.app.connection_for_write(transport=_CapturingTransport) as connection,
            connection.channel() as channel,
        ):
            producer = self.app.amqp.Producer(channel, auto_declare=False)
            common: dict[str, Any] = {
                "producer": producer,
                "reply_to": markers[3],
                "add_to_parent": False,
            }
            if way == _STEP:
                self.app.send_task(
                    task,
                    kwargs=kwargs,
                    task_id=markers[1],
                    ignore_result=True,
                    argsrepr="()",
                    kwargsrepr=markers[2],
                    **common,
                    **self._send_options(task),
                )
            else:  # as saga.unwind makes the signature and send_chain sends it
                if way == _CHAIN_IN_TASK:
                    common.update(root_id=markers[5], parent_id=markers[6])
                self.app.signature(
                    task,
                    kwargs=kwargs,
                    immutable=True,
                    task_id=markers[1],
                    **self._send_options(task),
                ).apply_async(**common)
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
    # A step's arguments are shown as the dispatcher wrote them (the marker, in the headers
    # and the properties); an unwind's as Celery's own repr of them, in the headers only.
    shown = headers.get("kwargsrepr")
    if not isinstance(shown, str):
        raise _NotPreparable("no repr of its arguments")
    if markers[2] not in shown:
        cut["headers"] = {**headers, "kwargsrepr": markers[2]}
    # A format string: the text's own braces doubled, each marker (plain hex, no braces) its
    # slot's field.
    text = _json_dumps(cut).replace("{", "{{").replace("}", "}}")
    for index, mark in enumerate(markers):
        text = text.replace(mark, f"{{{index}}}")
    if marker in text:
        raise _NotPreparable("a marker in an unexpected place")
    template = _Template(queue, text, decoded[2], "json")
    ids = [m for m in markers[5:] if m in pristine]
    body_now = _body(template, kwargs, template.embed)
    rebuilt = _fill(template, body_now, markers[1], shown, markers[3], tag, *ids)
    serialized = _serialized(template, kwargs, template.embed)
    if rebuilt != pristine or body != serialized or not _escapes_as_kombu():
        raise _NotPreparable("rebuilt from its pieces, it is not the message Celery made")
    return template


def _serialized(template: _Template, kwargs: dict[str, Any], embed: dict[str, Any]) -> str:
    _content_type, encoding, data = _serialize(((), kwargs, embed), serializer=template.serializer)
    return data if isinstance(data, str) else data.decode(encoding)


def _body(template: _Template, kwargs: dict[str, Any], embed: dict[str, Any]) -> str:
    """The body's base64: (args, kwargs, embed), the embed carrying an unwind's chain."""
    data = _serialized(template, kwargs, embed)
    return base64.b64encode(data.encode("utf-8")).decode("ascii")


def _fill(
    template: _Template,
    body: str,
    task_id: str,
    kwargsrepr: str,
    reply_to: str,
    tag: str,
    *ids: str,
) -> str:
    """The template with the call's values, each escaped as kombu's JSON escapes a string
    (``_escape``; the body is base64, which needs none). ``ids``: a worker task's root and
    parent ids, for a template made from inside one."""
    values = (task_id, kwargsrepr, reply_to, tag, *ids)
    return template.text.format(body, *(_escape(v) for v in values))


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
