"""Declaring an agent the workers host: its policy, the tools it may call, its limits, and which
failures it is told about instead of unwinding.

Everything is checked when the agent is declared (an unknown tool, a limit that makes no sense),
because the place it would otherwise surface is a worker, mid-run, where nobody is watching.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from enum import StrEnum

from saga.agents.policies import Policy
from saga.agents.schema import offered_tools
from saga.errors import ToolDefinitionError, UnknownAgentError
from saga.model import OnFailure, ToolClass
from saga.retry import RetryPolicy
from saga.rules import check_on_failure, failure_mode
from saga.tools import Tool, ToolRegistry
from saga.validation import AGENT_NAME

#: Agent names go in a 100-character column; 64 is plenty for a name a person reads.
_NAME = AGENT_NAME


class OnLimit(StrEnum):
    """What a run does when it reaches one of its limits."""

    #: Complete the run with what it has done (every step has settled by then).
    FINISH = "finish"
    #: Abort: unwind the stack, or escalate past the pivot.
    UNWIND = "unwind"


#: Model errors worth asking again (429, 5xx, no response) are retried this often, with this
#: backoff, unless the provider says how long to wait (``Retry-After``).
DEFAULT_MODEL_RETRY = RetryPolicy(attempts=5, backoff=1.0, backoff_max=30.0)


@dataclass(frozen=True)
class Limits:
    """How far one run of the agent may go. Checked when a turn starts (every step of the
    turn before has settled then, so finishing is always possible)."""

    max_turns: int = 20
    max_tool_calls: int = 50
    #: Error results in a row (refused, rejected, failed and fed back) the model may get;
    #: one more and the run unwinds: a model that keeps doing wrong things is stopped.
    max_consecutive_refusals: int = 3
    #: Model tokens (input and output, summed over the turns); None: no budget.
    token_budget: int | None = None
    #: What reaching the turn, tool call or token limit does (too many refusals always unwinds).
    on_limit: OnLimit | str = OnLimit.UNWIND

    def __post_init__(self) -> None:
        numbers = {
            "max_turns": self.max_turns,
            "max_tool_calls": self.max_tool_calls,
            "max_consecutive_refusals": self.max_consecutive_refusals,
            "token_budget": 1 if self.token_budget is None else self.token_budget,
        }
        bad = sorted(name for name, value in numbers.items() if value < 1)
        if bad:
            raise ToolDefinitionError(f"agent limits must be at least 1: {', '.join(bad)}")
        object.__setattr__(self, "on_limit", OnLimit(self.on_limit))  # "finish" works too


@dataclass(frozen=True)
class Agent:
    """One agent: the workers find it by ``name`` when a turn of one of its runs arrives."""

    name: str
    policy: Policy
    tools: tuple[Tool, ...]
    limits: Limits = field(default_factory=Limits)
    #: Per-tool overrides of the default (reads fed back, writes unwind).
    on_failure: Mapping[str, OnFailure] = field(default_factory=dict)
    model_retry: RetryPolicy = DEFAULT_MODEL_RETRY
    #: Seconds without progress before the reaper resolves a run (None: the app's default);
    #: a call awaiting approval expires after as long.
    deadline: int | None = None
    #: Irreversible tools a person must approve, call by call, before they are dispatched.
    approval: frozenset[str] = frozenset()

    def tool(self, name: str) -> Tool | None:
        """The tool ``name`` if this agent may call it."""
        return next((t for t in self.tools if t.name == name), None)

    def failure_mode(self, tool: Tool) -> OnFailure:
        return failure_mode(tool, self.on_failure)

    @property
    def tool_names(self) -> tuple[str, ...]:
        return tuple(t.name for t in self.tools)

    def __repr__(self) -> str:
        return f"Agent({self.name!r}, tools={list(self.tool_names)}, {self.limits})"


class AgentRegistry:
    """The agents one app hosts, checked against its tool registry."""

    def __init__(self, registry: ToolRegistry) -> None:
        self.registry = registry
        self._agents: dict[str, Agent] = {}

    def declare(
        self,
        name: str,
        policy: Policy,
        *,
        tools: Iterable[str] | None = None,
        limits: Limits | None = None,
        on_failure: Mapping[str, OnFailure | str] | None = None,
        model_retry: RetryPolicy | None = None,
        deadline: int | None = None,
        approval: Iterable[str] = (),
    ) -> Agent:
        """Declare ``name``: ``tools`` (default: every offered tool) must be registered and
        offered; ``on_failure`` may only name those tools; ``approval`` only its class 5 ones."""
        if not isinstance(name, str) or not _NAME.match(name):
            raise ToolDefinitionError(f"agent name {name!r} must match {_NAME.pattern}")
        if name in self._agents:
            raise ToolDefinitionError(f"agent {name} is declared twice")
        if not callable(policy):
            raise ToolDefinitionError(f"the policy of agent {name} must be callable")
        chosen = offered_tools(self.registry, tools)
        if not chosen:
            raise ToolDefinitionError(f"agent {name} is offered no tools")
        overrides = check_on_failure(f"agent {name}", on_failure, chosen)
        approved = check_approval(f"agent {name}", approval, chosen)
        if deadline is not None and deadline < 1:
            raise ToolDefinitionError(f"the deadline of agent {name} must be at least 1 s")
        agent = Agent(
            name=name,
            policy=policy,
            tools=chosen,
            limits=limits or Limits(),
            on_failure=overrides,
            model_retry=model_retry or DEFAULT_MODEL_RETRY,
            deadline=deadline,
            approval=approved,
        )
        self._agents[name] = agent
        return agent

    def get(self, name: str) -> Agent:
        try:
            return self._agents[name]
        except KeyError:
            known = ", ".join(sorted(self._agents)) or "(none)"
            raise UnknownAgentError(f"no agent {name!r} is declared; known: {known}") from None

    def __iter__(self) -> Iterator[Agent]:
        return iter(self._agents.values())

    def __len__(self) -> int:
        return len(self._agents)


def check_approval(owner: str, approval: Iterable[str], tools: Iterable[Tool]) -> frozenset[str]:
    """Only the irreversible (class 5) tools among ``tools`` can wait for a person."""
    classes = {t.name: t.tool_class for t in tools}
    chosen = frozenset(approval)
    for tool in sorted(chosen):
        if classes.get(tool) is not ToolClass.IRREVERSIBLE_WRITE:
            raise ToolDefinitionError(
                f"approval of {owner} names {tool!r}: only the irreversible (class 5) "
                "tools it may call can wait for a person"
            )
    return chosen
