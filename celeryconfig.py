"""Celery settings for saga workers: every URL from the environment, every default safe.

Why these defaults:
- JSON only: a pickle message on the queue is code execution waiting to happen.
- ``task_acks_late`` + ``task_reject_on_worker_lost``: a message is acknowledged only after its
  task has recorded its outcome (and pushed its undo), so a worker killed mid-step gives the
  step back to the queue instead of losing it.
- ``worker_prefetch_multiplier = 1``: a worker holds one unacknowledged message at a time, so a
  crash strands at most one step until the visibility timeout returns it.
- The visibility timeout is longer than any time limit or retry delay: otherwise Redis would
  hand a step still running (or waiting to retry) to a second worker.
- Worker task events on, so Flower shows every tool call and compensation as it runs.
"""

from __future__ import annotations

import os
import ssl

_redis = os.environ.get("SAGA_REDIS_URL", "redis://localhost:6379/0")

broker_url = os.environ.get("SAGA_BROKER_URL", _redis)
result_backend = os.environ.get("SAGA_RESULT_BACKEND", broker_url)

task_serializer = "json"
result_serializer = "json"
accept_content = ["json"]
result_accept_content = ["json"]

task_acks_late = True
task_reject_on_worker_lost = True
worker_prefetch_multiplier = 1

task_time_limit = int(os.environ.get("SAGA_TASK_TIME_LIMIT", "300"))
task_soft_time_limit = max(1, task_time_limit * 9 // 10)
#: Longest retry delay any tool may ask for (RetryPolicy.backoff_max defaults stay below it).
retry_delay_max = 600
_visibility = int(
    os.environ.get("SAGA_VISIBILITY_TIMEOUT", str(2 * max(task_time_limit, retry_delay_max)))
)
broker_transport_options = {
    "visibility_timeout": _visibility,
    # How often a running worker looks for messages a dead worker left unacknowledged (kombu's
    # default, 10 s x 10, makes a standby worker wait ~100 s past the visibility timeout).
    "unacked_restore_interval": max(1, min(60, _visibility // 3)),
    "unacked_restore_throttle": 1,
}
result_backend_transport_options = broker_transport_options
result_expires = 24 * 3600

# Agent turns wait on a model: they run on their own queue, served by a threads pool
# (`celery -A tasks.app worker -P threads -c 50 -Q saga.turns`), never in a prefork slot.
task_routes = {
    "saga.agent_turn": {"queue": "saga.turns"},
    "saga.start_unwind": {"queue": "saga.turns"},
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
if broker_url.startswith("rediss://"):
    broker_use_ssl = _tls
if result_backend.startswith("rediss://"):
    redis_backend_use_ssl = _tls

broker_connection_retry_on_startup = True
worker_hijack_root_logger = False

#: The reaper: resolves runs with no progress past their deadline (run `celery beat` too).
beat_schedule = {
    "saga-reaper": {
        "task": "saga.reap",
        "schedule": float(os.environ.get("SAGA_REAP_INTERVAL", "30")),
    },
}
