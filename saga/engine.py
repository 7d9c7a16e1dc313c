"""``Saga``: the one object an application builds, shared by the web app that starts runs and
the worker that executes them.

It owns the registries (tools, agents), builds the run transitions (``saga.core.Core``) over
them, installs the Celery tasks, and hands out what an app uses: ``Run``s, the hosted loop, the
reaper's pass and the operations. The moving parts depend on the core, never on this facade.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from typing import Any

from celery import Celery

from saga import metrics
from saga.agents.agent import Agent, AgentRegistry
from saga.agents.hosted import publish_hosted_agents
from saga.agents.launch import enqueue_run
from saga.agents.loop_listener import HostedLoop
from saga.agents.policies import Policy
from saga.core import Core
from saga.errors import RunExistsError, UnknownRunError
from saga.fault_points import FaultPoints
from saga.hooks import SagaHooks
from saga.model import OnFailure
from saga.notifications.notifier import Notifier
from saga.operations import decide_reversal, requeue, resolve
from saga.picture import RunPicture
from saga.reaper import ReapReport, reap
from saga.records import EscalationRecord, RecordStore
from saga.runs import Run, StepHandle
from saga.settings import Settings
from saga.tools import Tool, ToolRegistry
from saga.transport import use_pooled_client_transport
from saga.validation import check_deadline, check_flag, check_run_id
from saga.worker import install, install_tool


class Saga:
    """Tools, stack and records for one application, wired to one Celery app."""

    def __init__(
        self,
        app: Celery,
        registry: ToolRegistry,
        settings: Settings | None = None,
        hooks: SagaHooks | None = None,
    ) -> None:
        use_pooled_client_transport(app)
        #: The run transitions every moving part works with.
        self.core = core = Core(
            app, registry, settings or Settings.from_env(), hooks or SagaHooks()
        )
        self.app, self.registry, self.hooks, self.store = app, registry, core.hooks, core.store
        self.caller_tools, self.listeners = core.caller_tools, core.listeners
        #: The agents this app hosts, by name (its turn workers must declare them).
        self.agents = AgentRegistry(registry)
        self._agents_published = False
        #: Moves hosted runs on: any worker with the tools does, agents declared or not.
        self.hosted = HostedLoop(core)
        #: Escalation notices to the sinks of ``settings.notifications``.
        self.notifier = Notifier(core)
        core.listeners += [self.hosted, self.notifier]
        core.app_object = self
        install(app, core, agents=self.agents, notifier=self.notifier, reap=self.reap)
        registry.watch(self._tool_added)

    def _tool_added(self, tool: Tool) -> None:
        """A tool registered after this ``Saga`` was built: its task is installed at once, as
        the others were, so a worker that imported the registration runs it."""
        install_tool(self.app, self.core, tool)
        self.caller_tools.tool_added(tool.name)

    @property
    def settings(self) -> Settings:
        return self.core.settings

    @settings.setter
    def settings(self, settings: Settings) -> None:
        self.core.settings = settings

    @property
    def records(self) -> RecordStore:
        """Created on first use, so importing the app never touches the database."""
        return self.core.records

    @property
    def faults(self) -> FaultPoints | None:
        """Fault injection for tests; None unless SAGA_TESTING_FAULTS=1 is set explicitly."""
        return self.core.faults

    @faults.setter
    def faults(self, faults: FaultPoints | None) -> None:
        self.core.faults = faults

    # -- hosted agents --------------------------------------------------------------------

    def agent(self, name: str, policy: Policy, **options: Any) -> Agent:
        """Declare an agent the workers run by name (see ``saga.agents.Agent``)."""
        return self.agents.declare(name, policy, **options)

    def enqueue_run(self, agent: str, input: str, run_id: str | None = None) -> str:
        """Start a hosted run of ``agent`` and enqueue its first turn; return the run id at
        once. The same ``run_id`` twice starts one run."""
        if not self._agents_published:  # what this process knows, web apps may read too
            publish_hosted_agents(self.core, self.agents)
            self._agents_published = True
        deadline = self.agents.get(agent).deadline or self.settings.run_deadline_seconds
        limit = self.settings.max_payload_bytes
        return enqueue_run(self.store, self.app, agent, input, run_id, deadline, limit)

    # -- runs -----------------------------------------------------------------------------

    def start_run(
        self,
        run_id: str | None = None,
        *,
        allow_reversible_after_pivot: bool = False,
        deadline: float | None = None,
        on_failure: Mapping[str, OnFailure | str] | None = None,
    ) -> Run:
        """Start a run. ``deadline``: seconds without progress before the reaper resolves it.
        ``on_failure``: per tool, ``"feed_back"`` or ``"unwind"`` (``saga.runs.Run``).
        ``run_id`` (default: a random one): 1-128 characters of ``[A-Za-z0-9._-]``, starting
        with a letter or digit (``saga.validation``). Bad arguments change nothing."""
        run_id = uuid.uuid4().hex if run_id is None else check_run_id(run_id)
        if deadline is None:
            deadline = self.settings.run_deadline_seconds
        else:
            deadline = check_deadline(deadline)
        allow = check_flag("allow_reversible_after_pivot", allow_reversible_after_pivot)
        run = Run(self.core, run_id, on_failure)  # a bad on_failure is refused before it exists
        if not self.store.create(run_id, deadline, allow):
            raise RunExistsError(f"run {run_id} already exists")
        metrics.run_started()
        return run

    def run(self, run_id: str, on_failure: Mapping[str, OnFailure | str] | None = None) -> Run:
        """Attach to an existing run (from another process, or after a restart), with this
        process's ``on_failure`` for the calls it makes (``start_run``)."""
        run = Run(self.core, run_id, on_failure)
        if self.store.view(run_id) is None:
            raise UnknownRunError(f"no run {run_id}")
        return run

    def picture(self, run_id: str) -> RunPicture:
        return self.core.picture(run_id)

    def dispatch(
        self,
        run_id: str,
        tool_name: str,
        args: dict[str, Any],
        *,
        marker: str = "",
        feed_back_failure: bool = False,
    ) -> StepHandle:
        """``Run.call`` by run id (``saga.core.Core.dispatch``): the step's handle."""
        step = self.core.dispatch(
            run_id, tool_name, args, marker=marker, feed_back_failure=feed_back_failure
        )
        return StepHandle(self.core, run_id, step, tool_name)

    def complete(self, run_id: str) -> RunPicture:
        """End a run whose calls all settled: completed, recorded (``Run.finish``)."""
        return self.core.complete(run_id)

    def abort(self, run_id: str, reason: str, *, version: str = "") -> bool:
        """Unwind the run, or escalate past its pivot (``saga.core.Core.abort``)."""
        return self.core.abort(run_id, reason, version=version)

    # -- operations -----------------------------------------------------------------------

    def requeue_failed_compensations(
        self,
        run_id: str,
        *,
        corrections: Mapping[int, Mapping[str, Any]] | None = None,
        by: str = "",
    ) -> int:
        """Run an escalated run's failed compensations again, newest first, with a fresh retry
        budget; returns how many are sent. ``corrections``: step -> arguments merged into that
        undo first (checked; recorded with ``by``). Works from the SQL record once the run's
        keys expired (``saga.operations``)."""
        return requeue(self.core, run_id, corrections or {}, by)

    def resolve_escalation(self, escalation_id: str, *, note: str, by: str) -> EscalationRecord:
        """Close an escalation by hand ("refunded by phone"), recorded with who and when; the
        run then refuses a requeue. ``UnknownEscalationError`` / ``EscalationResolvedError``
        for an id that is not open."""
        return resolve(self.core, escalation_id, note=note, by=by)

    def decide_reversal(
        self, run_id: str, step: int, decision: str, *, args_hash: str, by: str, note: str = ""
    ) -> RunPicture:
        """A person's answer when an undo's reversal policy asked (``reversal="ask"``):
        ``reverse`` it now, ``keep`` the effect (``note`` says why), or decide ``later``
        (``saga.operations.decide_reversal``)."""
        return decide_reversal(
            self.core, run_id, step, decision, args_hash=args_hash, by=by, note=note
        )

    def reap(self, now: float | None = None) -> ReapReport:
        """Resolve every run with no progress past its deadline (the beat task calls this).

        ``now`` lets a test look at the runs as the clock will see them later."""
        return reap(self.core, self.notifier, now)
