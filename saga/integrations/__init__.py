"""saga under the agent frameworks you already use: each tool call the framework's agent makes
is a step of a saga run, with the same rules as our own loop (``saga.agents``).

- ``saga.integrations.pydantic_ai.SagaToolset``: a Pydantic AI toolset
  (``pip install 'saga-compensation[pydantic-ai]'``).
- ``saga.integrations.openai_agents.function_tools``: OpenAI Agents SDK function tools
  (``pip install 'saga-compensation[openai-agents]'``).

Both offer the tools of a run's ``Saga`` (never its compensations), described as our loop
describes them; send each call through the run's dispatcher and wait for its step; tell the
model about what it can fix (bad arguments, a class 5 call too early, a reversible call past
the pivot, a ``ToolRejected``); and stop the agent with the saga's error when a failed write
unwinds the run. Nothing is imported here: each module imports its own framework.

Beside them, ``saga.integrations.flower``: Flower for operators, behind basic auth and with its
control routes refused.
"""
