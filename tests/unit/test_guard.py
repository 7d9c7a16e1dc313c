"""The start-up guard's visibility checks: a retried step is delivered at once, held for its
countdown, then run for up to the time limit, and all of that must end before Redis hands the
message to another worker. Pure configuration: no Redis, no worker.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Iterator
from types import ModuleType
from typing import Any

import pytest

from saga.guard import RUN_TIME_MARGIN, configuration_problems, longest_retry_delay
from saga.retry import DEFAULT_COMPENSATION_RETRY, DEFAULT_RETRY, RetryPolicy
from saga.tools import ToolRegistry

REDIS_CONF: dict[str, Any] = {
    "broker_url": "redis://127.0.0.1:6379/0",
    "accept_content": ["json"],
    "result_accept_content": ["json"],
    "task_serializer": "json",
    "result_serializer": "json",
    "task_acks_late": True,
    "task_time_limit": 300,
    "task_soft_time_limit": 270,
    "broker_transport_options": {"visibility_timeout": 1200},
}


def settings_of(module: ModuleType) -> dict[str, Any]:
    return {name: getattr(module, name) for name in module.__all__}


def policies_of(registry: ToolRegistry) -> dict[str, RetryPolicy]:
    return {tool.name: tool.retry for tool in registry}


def fixed(delay: float, attempts: int = 2) -> RetryPolicy:
    """A policy whose every retry waits exactly ``delay`` seconds."""
    return RetryPolicy(attempts=attempts, backoff=delay, backoff_max=delay, jitter=False)


#: Read from the environment when first imported: a test that imports them must leave no copy
#: behind, or a later test (or the integration tier's app) would see this test's environment.
_SETTINGS_MODULES = ("celeryconfig", "saga.celery_defaults")


@pytest.fixture
def load(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[..., ModuleType]]:
    """``load(module, **env)``: a fresh import of ``module`` under ``env``; forgotten after."""

    def forget() -> None:
        for name in _SETTINGS_MODULES:
            sys.modules.pop(name, None)

    def fresh(module: str = "saga.celery_defaults", **env: str) -> ModuleType:
        for name in ("SAGA_TASK_TIME_LIMIT", "SAGA_VISIBILITY_TIMEOUT"):
            monkeypatch.delenv(name, raising=False)  # the shipped defaults, unless given
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        forget()
        return importlib.import_module(module)

    yield fresh
    forget()


# -- the sum per tool (review R7) ------------------------------------------------------------


def test_a_retry_delay_plus_the_time_limit_past_the_visibility_timeout_is_refused(
    load: Callable[..., ModuleType],
) -> None:
    """R7: with the shipped defaults (limit 300 s, visibility 1200 s), a 1000 s retry delay
    passes each separate check but not their sum, and the refusal names the tool."""
    conf = settings_of(load())
    policies = {"get_order": DEFAULT_RETRY, "issue_credit": fixed(1000, attempts=3)}

    problems = configuration_problems(conf, policies, [])

    assert len(problems) == 1
    assert problems[0].startswith("tool issue_credit: the longest retry delay (1000s) plus ")
    assert "task_time_limit (300s)" in problems[0]
    assert "visibility timeout (1200s)" in problems[0]
    assert "get_order" not in problems[0]


def test_the_bound_is_the_delay_plus_the_limit_plus_the_margin() -> None:
    """Just below visibility - limit - margin passes; at it, the tool is refused."""
    fits = 1200 - 300 - RUN_TIME_MARGIN - 1
    at_bound = 1200 - 300 - RUN_TIME_MARGIN

    assert configuration_problems(REDIS_CONF, {"fits": fixed(fits)}, []) == []
    [problem] = configuration_problems(REDIS_CONF, {"at_bound": fixed(at_bound)}, [])
    assert problem.startswith("tool at_bound:")


def test_tools_with_the_same_slow_policy_are_named_together_and_sorted() -> None:
    """One line per offending delay, naming every tool that has it; fine tools stay out."""
    slow, slower = fixed(950), fixed(1000)
    policies = {"b_tool": slow, "a_tool": slow, "c_tool": slower, "fine": DEFAULT_RETRY}

    problems = configuration_problems(REDIS_CONF, policies, [])

    assert [p.split(":")[0] for p in problems] == ["tools a_tool, b_tool", "tool c_tool"]


def test_a_time_limit_past_the_visibility_timeout_is_named_once_not_per_tool() -> None:
    """When the limit alone is too long, that is the one problem: listing every tool adds
    nothing."""
    conf = {**REDIS_CONF, "task_time_limit": 1200}

    problems = configuration_problems(conf, {"a": DEFAULT_RETRY, "b": fixed(500)}, [])

    assert problems == [
        "task_time_limit (1200s) is not below the visibility timeout (1200s): Redis would hand "
        "the task to a second worker while the first still has it"
    ]


@pytest.mark.parametrize("limit", [None, 0])
def test_a_missing_time_limit_is_refused_on_a_redis_broker(limit: int | None) -> None:
    """With no time limit nothing bounds how long a step holds its message."""
    conf = {**REDIS_CONF, "task_time_limit": limit, "task_soft_time_limit": None}

    [problem] = configuration_problems(conf, {"get_order": DEFAULT_RETRY}, [])

    assert problem.startswith(f"task_time_limit is {limit!r}: on a Redis broker nothing")


def test_on_amqp_the_consumer_timeout_takes_the_visibility_timeouts_place(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """RabbitMQ has no visibility timeout, but redelivers a delivery held past its consumer
    timeout (SAGA_RABBITMQ_CONSUMER_TIMEOUT, 1800 s by default): no time limit is refused."""
    monkeypatch.delenv("SAGA_RABBITMQ_CONSUMER_TIMEOUT", raising=False)
    conf = {**REDIS_CONF, "broker_url": "amqp://guest@localhost//", "task_time_limit": None}

    (problem,) = configuration_problems(conf, {"slow": fixed(5000)}, [])
    assert problem.startswith("task_time_limit is None: on RabbitMQ")
    assert configuration_problems({**conf, "task_time_limit": 300}, {"quick": fixed(5)}, []) == []


# -- the longest delay a policy asks for ------------------------------------------------------


@pytest.mark.parametrize(
    ("policy", "longest"),
    [
        (RetryPolicy(attempts=1, backoff=100, backoff_max=100), 0.0),  # never retried
        (RetryPolicy(attempts=2, backoff=3, backoff_max=60), 3.0),  # one retry, after attempt 1
        (RetryPolicy(attempts=3, backoff=0.2, backoff_max=2.0), 0.4),  # the doubling stops early
        (RetryPolicy(attempts=10, backoff=1, backoff_max=60), 60.0),  # the cap
        (RetryPolicy(attempts=5000, backoff=1, backoff_max=60), 60.0),  # 2**4998 overflows
        (RetryPolicy(attempts=4, backoff=10, backoff_max=100, jitter=True), 40.0),  # jitter: <=
    ],
)
def test_longest_retry_delay(policy: RetryPolicy, longest: float) -> None:
    """The countdown after the last attempt that is retried, jitter-free and capped."""
    assert longest_retry_delay(policy) == pytest.approx(longest)


# -- the settings that ship, and the tests' own -----------------------------------------------


def test_the_shipped_defaults_pass_with_every_tool_at_the_expected_longest_delay(
    load: Callable[..., ModuleType],
) -> None:
    """saga.celery_defaults leave room for a tool at ``retry_delay_max`` plus the time limit."""
    defaults = load()
    conf = settings_of(defaults)
    policies = {
        "default": DEFAULT_RETRY,
        "compensation": DEFAULT_COMPENSATION_RETRY,
        "slowest": fixed(defaults.retry_delay_max),
    }

    assert configuration_problems(conf, policies, []) == []


@pytest.mark.parametrize("limit", ["1", "5", "60", "300", "3600"])
def test_the_default_visibility_follows_the_time_limit(
    load: Callable[..., ModuleType], limit: str
) -> None:
    """Whatever SAGA_TASK_TIME_LIMIT says, the derived visibility timeout passes the guard."""
    defaults = load(SAGA_TASK_TIME_LIMIT=limit)
    slowest = fixed(defaults.retry_delay_max)

    assert defaults.task_time_limit == int(limit)
    assert configuration_problems(settings_of(defaults), {"slowest": slowest}, []) == []


def test_the_environment_still_sets_the_visibility_timeout(
    load: Callable[..., ModuleType],
) -> None:
    """SAGA_VISIBILITY_TIMEOUT wins over the derived default, and the guard then judges it."""
    defaults = load(SAGA_VISIBILITY_TIMEOUT="7", SAGA_TASK_TIME_LIMIT="5")

    assert defaults.broker_transport_options["visibility_timeout"] == 7
    [problem] = configuration_problems(settings_of(defaults), {"slow": fixed(2)}, [])
    assert problem.startswith("tool slow:")


def test_the_app_config_module_is_the_package_defaults(load: Callable[..., ModuleType]) -> None:
    """celeryconfig.py (the demo app's) star-imports saga.celery_defaults and loses nothing."""
    celeryconfig = load("celeryconfig")
    defaults = sys.modules["saga.celery_defaults"]

    assert {n: getattr(celeryconfig, n) for n in defaults.__all__} == settings_of(defaults)
    assert celeryconfig.beat_schedule["saga-reaper"]["task"] == "saga.reap"


def test_the_reliability_settings_pass_with_the_demo_tools() -> None:
    """tests/reliability's visibility and time limit leave room for every demo tool's retry."""
    from tasks.tools import tools
    from tests.reliability.conftest import TIME_LIMIT, VISIBILITY_TIMEOUT

    conf = {
        **REDIS_CONF,
        "task_time_limit": TIME_LIMIT,
        "task_soft_time_limit": TIME_LIMIT - 1,
        "broker_transport_options": {"visibility_timeout": VISIBILITY_TIMEOUT},
    }
    assert configuration_problems(conf, policies_of(tools), []) == []


def test_the_chaos_settings_pass_with_the_chaos_tools(load: Callable[..., ModuleType]) -> None:
    """The chaos run's visibility and time limit leave room for every chaos tool's retry."""
    from tests.reliability.chaos import TIME_LIMIT, VISIBILITY_TIMEOUT

    load("celeryconfig")  # chaos_app reads it at import; the fixture forgets it afterwards
    from tests.reliability.chaos_app import tools

    conf = {
        **REDIS_CONF,
        "task_time_limit": TIME_LIMIT,
        "task_soft_time_limit": TIME_LIMIT - 1,
        "broker_transport_options": {"visibility_timeout": VISIBILITY_TIMEOUT},
    }
    assert configuration_problems(conf, policies_of(tools), []) == []
