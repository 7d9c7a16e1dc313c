"""``saga.soft_limit`` in this process, with billiard's soft-limit handler installed as a pool
process installs it, and the signal sent as billiard's timer sends it."""

from __future__ import annotations

import logging
import os
import signal
from collections.abc import Iterator

import pytest
from billiard.pool import soft_timeout_sighandler  # type: ignore[import-untyped]
from celery.exceptions import SoftTimeLimitExceeded

from saga import soft_limit
from saga.soft_limit import call_time, kept_for_the_call


@pytest.fixture
def pool_process(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """This process's SIGUSR1 handled as in a new billiard pool process, put back afterwards."""
    monkeypatch.setattr(soft_limit._delivery, "installed_in", 0)
    previous = signal.signal(signal.SIGUSR1, soft_timeout_sighandler)
    yield
    signal.signal(signal.SIGUSR1, previous)


def the_soft_limit_arrives() -> None:
    os.kill(os.getpid(), signal.SIGUSR1)


def test_in_the_tools_call_it_raises_as_celerys_does(pool_process: None) -> None:
    with kept_for_the_call("t"), pytest.raises(SoftTimeLimitExceeded), call_time():
        the_soft_limit_arrives()


def test_saga_takes_billiards_place_and_raises_as_it_outside_a_tools_delivery(
    pool_process: None,
) -> None:
    with kept_for_the_call("t"):
        taken = signal.getsignal(signal.SIGUSR1)
    assert taken is not soft_timeout_sighandler
    assert signal.getsignal(signal.SIGUSR1) is taken  # kept for the process's next deliveries
    with pytest.raises(SoftTimeLimitExceeded):  # another task's time (a conclusion's)
        the_soft_limit_arrives()


def test_while_saga_records_it_is_noted_and_the_recording_finishes(
    pool_process: None, caplog: pytest.LogCaptureFixture
) -> None:
    recorded = []
    with caplog.at_level(logging.WARNING, "saga.worker"), kept_for_the_call("reverse_credit[x]"):
        with call_time():
            pass
        the_soft_limit_arrives()
        recorded.append("the retry")
    assert recorded == ["the retry"]
    assert "reverse_credit[x]: the soft time limit came while saga recorded" in caplog.text


def test_before_the_tools_call_it_is_raised_as_the_call_begins_and_only_once(
    pool_process: None, caplog: pytest.LogCaptureFixture
) -> None:
    called = []
    with kept_for_the_call("t"):
        the_soft_limit_arrives()
        with pytest.raises(SoftTimeLimitExceeded), call_time():
            called.append("the tool")
        with call_time():  # the lookup after the failure: Celery sends the signal once
            called.append("its lookup")
    assert called == ["its lookup"]
    assert "soft time limit came" not in caplog.text


def test_outside_a_pool_process_nothing_changes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(soft_limit._delivery, "installed_in", 0)
    before = signal.getsignal(signal.SIGUSR1)
    with kept_for_the_call("t"), call_time():
        assert signal.getsignal(signal.SIGUSR1) is before
    assert signal.getsignal(signal.SIGUSR1) is before
