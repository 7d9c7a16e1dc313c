"""The demo app's Celery settings: saga's safe defaults (``saga.celery_defaults``, read from
the ``SAGA_*`` environment), and nothing of its own yet.

An app with settings of its own adds them below the import; one with periodic tasks of its own
extends ``beat_schedule`` (which already schedules saga's reaper) instead of replacing it.
"""

from saga.celery_defaults import *  # noqa: F403 - this module is a list of settings
