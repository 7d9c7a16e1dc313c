"""saga.agents: talk to a model about saga's tools, in the three formats models speak.

Offer the registry's tools (``tool_definitions``), read what the model asked for
(``parse_response`` → ``ModelTurn`` of ``ToolCall``s), keep the conversation (``Transcript``),
send the ``ToolResult``s back, and decide the next turn with a policy (``ChatModelPolicy`` over
the user's own OpenAI or Anthropic client, or ``ScriptedPolicy``). No model SDK is imported; the
SDKs are optional extras. Declare an ``Agent`` (``saga.agent(...)``) and the workers host its
loop (``hosted``: one Celery task per turn); nothing here imports Celery.
"""

from saga.agents.agent import Agent, AgentRegistry, Limits, OnLimit
from saga.agents.chat_model import DEFAULT_ANTHROPIC_MAX_TOKENS, ChatModelPolicy
from saga.agents.formats import parse_response, tool_definitions, wire_format
from saga.agents.messages import ModelFormat, ModelTurn, ToolCall, ToolResult, Usage
from saga.agents.model_errors import model_call_error
from saga.agents.policies import Policy, ScriptedPolicy, ScriptStep, take_turn
from saga.agents.schema import CLASS_SENTENCES, offered_tools
from saga.agents.transcript import Transcript
from saga.errors import ApprovalError, ConversationError, ModelCallError, UnknownAgentError
from saga.model import OnFailure

__all__ = [
    # Offering tools
    "CLASS_SENTENCES",
    "ModelFormat",
    "offered_tools",
    "tool_definitions",
    "wire_format",
    # The conversation
    "ModelTurn",
    "ToolCall",
    "ToolResult",
    "Transcript",
    "Usage",
    "parse_response",
    # Deciding the next turn
    "ChatModelPolicy",
    "DEFAULT_ANTHROPIC_MAX_TOKENS",
    "Policy",
    "ScriptStep",
    "ScriptedPolicy",
    "take_turn",
    # Hosting an agent on the workers
    "Agent",
    "AgentRegistry",
    "Limits",
    "OnFailure",
    "OnLimit",
    # Errors
    "ApprovalError",
    "ConversationError",
    "ModelCallError",
    "UnknownAgentError",
    "model_call_error",
]
