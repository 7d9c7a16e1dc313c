"""Celery settings for saga workers: every URL from the environment, every default safe.

Use them as they are (``app.config_from_object("saga.celery_defaults")``) or star-import them
into an app's own config module and add to them. They are read from the environment once, when
this module is first imported.

Why these defaults:
- JSON only: a pickle message on the queue is code execution waiting to happen.
- ``task_acks_late`` + ``task_reject_on_worker_lost``: a message is acknowledged only after its
  task has recorded its outcome (and pushed its undo), so a worker killed mid-step gives the
  step back to the queue instead of losing it.
- ``worker_prefetch_multiplier = 1``: a worker holds one unacknowledged message at a time, so a
  crash strands at most one step until the visibility timeout returns it.
- The visibility timeout outlasts the longest retry delay plus the time limit: a retried message
  is delivered at once and held for its countdown before it runs, and Redis would hand a step
  still waiting or running to a second worker (the worker's start-up guard checks each tool).
- On RabbitMQ (``saga.celery_amqp``): quorum queues on a topic exchange, so a retry's countdown
  waits in the broker (native delayed delivery), and publisher confirms; the results go to the
  stack's Redis. On Redis, Celery's own defaults for those.
- Worker task events on, so Flower shows every tool call and compensation as it runs.
- The reaper scheduled for ``celery beat``: it is what resolves runs nobody drives any more, so
  it ships with the library's settings rather than each app's.
"""

from __future__ import annotations

import os
import ssl
from typing import Any

from saga import celery_amqp
from saga.constants import AGENT_TURN_TASK, REAP_TASK, START_UNWIND_TASK, TURN_QUEUE
from saga.redis_urls import (
    SENTINEL_SCHEMES,
    is_cluster,
    is_tls,
    kombu_url,
    sentinel_transport_options,
)
from saga.settings import (
    DEFAULT_REDIS_URL,
    broker_url_from_env,
    check_not_cluster,
    redis_url_from_env,
)

__all__ = [
    "accept_content",
    "beat_schedule",
    "broker_connection_retry_on_startup",
    "broker_transport_options",
    "broker_url",
    "broker_use_ssl",
    "result_accept_content",
    "result_backend",
    "result_backend_transport_options",
    "result_expires",
    "result_serializer",
    "redis_backend_use_ssl",
    "retry_delay_max",
    "task_acks_late",
    "task_create_missing_queue_exchange_type",
    "task_create_missing_queue_type",
    "task_default_exchange",
    "task_default_exchange_type",
    "task_default_queue_type",
    "task_queues",
    "task_reject_on_worker_lost",
    "task_send_sent_event",
    "task_serializer",
    "task_soft_time_limit",
    "task_routes",
    "task_time_limit",
    "task_track_started",
    "worker_hijack_root_logger",
    "worker_prefetch_multiplier",
    "worker_send_task_events",
]

# SAGA_REDIS_PASSWORD (or SAGA_REDIS_PASSWORD_FILE) goes into each URL that has none, escaped.
_redis = redis_url_from_env("SAGA_REDIS_URL", DEFAULT_REDIS_URL)
# (SAGA_REDIS_PASSWORD is Redis's: a RabbitMQ URL's is SAGA_BROKER_PASSWORD, or its own.)
_broker = broker_url_from_env(_redis)
check_not_cluster(
    "SAGA_BROKER_URL" if os.environ.get("SAGA_BROKER_URL") else "SAGA_REDIS_URL", _broker
)
_amqp = celery_amqp.amqp_settings(_broker)
# Results never go to RabbitMQ's queues as Celery's amqp backend (gone from Celery): to the
# stack's Redis unless told, or over RabbitMQ's replies (rpc://) when that Redis is a cluster,
# which Celery's Redis backend cannot use either. saga's own tasks keep no results.
_results_default = ("rpc://" if is_cluster(_redis) else _redis) if _amqp else _broker
_backend = redis_url_from_env("SAGA_RESULT_BACKEND", _results_default)
check_not_cluster("SAGA_RESULT_BACKEND", _backend)
# A redis+sentinel:// URL in kombu's spelling (sentinel://...;sentinel://...), the master's
# name in the transport options below (docs/deployment.md, "Sentinel").
broker_url, result_backend = kombu_url(_broker), kombu_url(_backend)

task_serializer = "json"
result_serializer = "json"
accept_content = ["json"]
result_accept_content = ["json"]

task_acks_late = True
task_reject_on_worker_lost = True
worker_prefetch_multiplier = 1

task_time_limit = int(os.environ.get("SAGA_TASK_TIME_LIMIT", "300"))
task_soft_time_limit = max(1, task_time_limit * 9 // 10)
#: Longest retry delay a tool is expected to ask for (the retry policies' defaults stay well
#: below it); the guard checks every tool's actual policy against the visibility timeout.
retry_delay_max = 600
#: Besides the guard's own margin, one more time limit (at least a minute): a retry whose
#: countdown ends while every pool process is busy waits for one to free up.
_visibility = int(
    os.environ.get(
        "SAGA_VISIBILITY_TIMEOUT",
        str(retry_delay_max + task_time_limit + max(task_time_limit, 60)),
    )
)
broker_transport_options: dict[str, Any] = {
    "visibility_timeout": _visibility,
    # How often a running worker looks for messages a dead worker left unacknowledged (kombu's
    # default, 10 s x 10, makes a standby worker wait ~100 s past the visibility timeout).
    "unacked_restore_interval": max(1, min(60, _visibility // 3)),
    "unacked_restore_throttle": 1,
    # The master's name from the first URL that names one (Flower's names only the broker).
    **sentinel_transport_options(
        next((u for u in (_redis, _broker, _backend) if u.startswith(SENTINEL_SCHEMES)), _redis),
        broker_url,
        result_backend,
    ),
}
result_backend_transport_options = broker_transport_options
if _amqp:  # the visibility timeout is Redis's (the results' still); RabbitMQ gets confirms
    broker_transport_options = _amqp["broker_transport_options"]
task_queues: tuple[Any, ...] | None = _amqp.get("task_queues")
task_default_exchange: str | None = _amqp.get("task_default_exchange")
task_default_exchange_type: str = _amqp.get("task_default_exchange_type", "direct")
task_default_queue_type: str = _amqp.get("task_default_queue_type", "classic")
task_create_missing_queue_type: str = _amqp.get("task_create_missing_queue_type", "classic")
task_create_missing_queue_exchange_type: str | None = _amqp.get(
    "task_create_missing_queue_exchange_type"
)
result_expires = 24 * 3600

# Hosted agents' turns wait on a model: they run on their own queue, served by a threads pool
# (`celery -A tasks.app worker -P threads -c 50 -Q saga.turns`), never in a prefork slot.
task_routes: dict[str, dict[str, str]] = {
    AGENT_TURN_TASK: {"queue": TURN_QUEUE},
    START_UNWIND_TASK: {"queue": TURN_QUEUE},
}

worker_send_task_events = True
# Flower sees every task from the worker's events (received, started, succeeded, failed...).
# The extra "sent" event would double every publish from the agent's process.
task_send_sent_event = False
task_track_started = True

# TLS (rediss:// URLs): certificates are always checked. SAGA_REDIS_SSL_CA names the CA file;
# SAGA_REDIS_SSL_CERT and SAGA_REDIS_SSL_KEY a client certificate, where the server wants one.
_tls = {
    "ssl_cert_reqs": ssl.CERT_REQUIRED,
    "ssl_ca_certs": os.environ.get("SAGA_REDIS_SSL_CA"),
    "ssl_certfile": os.environ.get("SAGA_REDIS_SSL_CERT"),
    "ssl_keyfile": os.environ.get("SAGA_REDIS_SSL_KEY"),
}
# (None is Celery's own default: no TLS.)
broker_use_ssl = _tls if is_tls(_broker) else None
redis_backend_use_ssl = _tls if is_tls(_backend) else None

broker_connection_retry_on_startup = True
worker_hijack_root_logger = False

#: The reaper: resolves runs with no progress past their deadline (run ``celery beat`` too).
#: An app with tasks of its own to schedule adds them to this dict instead of replacing it.
beat_schedule: dict[str, dict[str, Any]] = {
    "saga-reaper": {
        "task": REAP_TASK,
        "schedule": float(os.environ.get("SAGA_REAP_INTERVAL", "30")),
    },
}
