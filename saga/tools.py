"""Tool declarations: what a tool is, which class it belongs to, and how its effect is undone.

Everything a tool declares is checked when it is declared, loudly, because the place it would
otherwise surface is the failure path, where nobody is watching.
"""

from __future__ import annotations

import inspect
import json
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, get_type_hints

from pydantic import BaseModel, ConfigDict, ValidationError, create_model
from pydantic_core import ErrorDetails, PydanticSerializationError, to_json

from saga.errors import (
    CompensationBuildError,
    InvalidArgumentsError,
    ToolDefinitionError,
    ToolNotOfferedError,
    UnknownToolError,
)
from saga.model import ToolClass, Undo
from saga.retry import DEFAULT_COMPENSATION_RETRY, DEFAULT_RETRY, RetryPolicy

ToolFunction = Callable[..., Any]
#: Builds the undo from the call's (JSON) arguments and its result.
CompensationBuilder = Callable[[dict[str, Any], Any], Undo]
#: Finds a step's effect by its idempotency key: the result the call returned, or None if the
#: effect never happened. Used to reconcile a step whose outcome is in doubt.
EffectLookup = Callable[[str, dict[str, Any]], Any]
#: Reads the system and says whether the effect made under this idempotency key is live now:
#: ``False``/``0`` (never made, or undone), ``True``/``1`` (live), or how many times it is live
#: (``2``: applied twice). ``saga drill`` judges each case by it, not by saga's own word.
EffectVerify = Callable[[str, dict[str, Any]], bool | int]

_NAME = re.compile(r"^[a-z][a-z0-9_]*$")
_CONTEXT_PARAMETER = "ctx"
_TOOL_OPTIONS = frozenset(
    {"name", "compensation", "retry", "offered", "description", "lookup", "verify", "reversal"}
)
#: Whether a person decides before a step's effect is reversed: never (``auto``), always
#: (``ask``), or when a predicate of the step's arguments and result says so (``ask_when``).
ReversalPredicate = Callable[[dict[str, Any], Any], bool]
REVERSAL_AUTO, REVERSAL_ASK = "auto", "ask"
#: A compensation is never offered to the agent; register a tool with ``tool()`` to offer it
#: (any registered tool can be named in an ``Undo``, as ``set_ticket_status`` undoes itself).
_COMPENSATION_OPTIONS = frozenset({"name", "retry", "description", "verify"})


@dataclass(frozen=True)
class Tool:
    name: str
    func: ToolFunction
    #: ``None`` for a tool that only exists to undo others.
    tool_class: ToolClass | None
    compensation: CompensationBuilder | None
    retry: RetryPolicy
    offered: bool
    description: str
    schema: type[BaseModel]
    wants_context: bool
    lookup: EffectLookup | None = None
    #: Whether the effect is live in the system now (``saga.testing.drill`` asks it).
    verify: EffectVerify | None = None
    #: ``"auto"`` (the undo runs when the run unwinds), ``"ask"`` (a person decides first), or
    #: a predicate of the step's arguments and result: ask when it is true.
    reversal: str | ReversalPredicate = REVERSAL_AUTO

    def asks_before_reversal(self, args: dict[str, Any], result: Any) -> bool:
        """Whether a person decides before this step's effect is reversed: judged when the
        undo is pushed, on the arguments and result it captured. A predicate that raises asks
        (a person weighs what the code could not)."""
        return bool(self.reversal_question(args, result))

    def reversal_question(self, args: dict[str, Any], result: Any) -> str:
        """Why a person is asked before this step's effect is reversed, in words the person
        reads beside the question ('' when nobody is asked)."""
        if self.reversal == REVERSAL_AUTO:
            return ""
        if self.reversal == REVERSAL_ASK:
            return f"{self.name} always asks a person first (reversal='ask')"
        name = str(getattr(self.reversal, "__name__", ""))
        # A lambda's name says nothing: the predicate is named by what it is then.
        said = f"{name}(args, result)" if name.isidentifier() else f"{self.name}'s predicate"
        try:
            asks = bool(self.reversal(args, result))  # type: ignore[operator]
        except Exception as exc:
            return f"{said} raised {type(exc).__name__}: a person weighs it"
        return f"{said} was true for this step" if asks else ""

    def validate(self, args: dict[str, Any]) -> dict[str, Any]:
        """Check ``args`` against the schema; return them in JSON form, ready to send."""
        return self._parse(args).model_dump(mode="json")

    def json_schema(self) -> dict[str, Any]:
        """The parameters as a model is told about them (JSON Schema).

        Validation is strict, so this is exactly what is accepted: ``"integer"`` takes no
        ``true`` and no ``"1200"``; a ``date`` is a string in ISO format.
        """
        return self.schema.model_json_schema()

    def python_args(self, args: dict[str, Any]) -> dict[str, Any]:
        """The arguments as the function's type hints want them (``Decimal``, ``date``, ...)."""
        model = self._parse(args)
        return {name: getattr(model, name) for name in type(model).model_fields}

    def build_undo(self, args: dict[str, Any], result: Any) -> Undo:
        if self.compensation is None:
            raise CompensationBuildError(f"tool {self.name} declares no compensation")
        try:
            undo = self.compensation(args, result)
        except Exception as exc:
            raise CompensationBuildError(
                f"compensation of {self.name} raised {type(exc).__name__}: {exc}"
            ) from exc
        if not isinstance(undo, Undo):
            raise CompensationBuildError(
                f"compensation of {self.name} returned {type(undo).__name__}, not an Undo"
            )
        return undo

    def _parse(self, args: dict[str, Any]) -> BaseModel:
        """Validate strictly, as JSON: a model's arguments are JSON values, so ``"2024-05-01"``
        is a fine ``date`` but ``"1200"`` is no ``int`` and ``true`` no amount of cents (lax
        validation would charge 1 cent). Python values (an undo built from a result holding a
        ``Decimal``) are written as JSON first, so both meet the same rules."""
        if not isinstance(args, dict):
            raise InvalidArgumentsError(f"arguments of {self.name} must be an object")
        try:
            text = to_json(args)
        except PydanticSerializationError as exc:
            raise InvalidArgumentsError(f"arguments of {self.name} are not JSON: {exc}") from None
        try:
            return self.schema.model_validate_json(text, strict=True)
        except ValidationError as exc:
            problems = "; ".join(_problem(error) for error in exc.errors(include_url=False))
            raise InvalidArgumentsError(f"invalid arguments for {self.name}: {problems}") from None


class ToolRegistry:
    """The tools one application offers its agent, and the compensations behind them."""

    def __init__(self) -> None:
        self._tools: dict[str, Tool] = {}
        #: Told of each tool registered from now on: a ``Saga`` built on this registry installs
        #: its Celery task at once, so a tool registered after the ``Saga`` runs like the others.
        self._watchers: list[Callable[[Tool], None]] = []

    def watch(self, added: Callable[[Tool], None]) -> None:
        """Call ``added`` with every tool registered after this call."""
        self._watchers.append(added)

    def tool(
        self, tool_class: ToolClass | int, **options: Any
    ) -> Callable[[ToolFunction], ToolFunction]:
        """Register a forward tool of ``tool_class``.

        Options: ``compensation`` (required for classes 3 and 4, refused otherwise), ``retry``,
        ``name``, ``description``, ``offered`` (default True: the agent may call it), ``lookup``
        (writes only: finds the effect by idempotency key when the step's outcome is in doubt),
        ``verify`` (writes only: whether the effect is live now, for ``saga drill``),
        ``reversal`` (``"auto"``, ``"ask"``, or a predicate of the arguments and result: a
        person decides before the effect is reversed; ``docs/operations.md``).
        """
        _refuse_unknown(options, _TOOL_OPTIONS)
        try:
            klass = ToolClass(tool_class)
        except ValueError:
            raise ToolDefinitionError(f"unknown tool class {tool_class!r}: use 1 to 5") from None

        def register(func: ToolFunction) -> ToolFunction:
            compensation = options.get("compensation")
            name = options.get("name", func.__name__)
            if klass.needs_compensation and compensation is None:
                raise ToolDefinitionError(
                    f"tool {name} is class {klass.value} ({klass.name.lower()}) and must declare "
                    "a compensation"
                )
            if not klass.needs_compensation and compensation is not None:
                raise ToolDefinitionError(
                    f"tool {name} is class {klass.value} ({klass.name.lower()}): it takes no "
                    "compensation (only classes 3 and 4 do)"
                )
            if compensation is not None and not callable(compensation):
                raise ToolDefinitionError(f"compensation of {name} must be callable")
            lookup = options.get("lookup")
            if lookup is not None and (not callable(lookup) or not klass.is_write):
                raise ToolDefinitionError(f"lookup of {name} must be callable, on a write tool")
            verify = options.get("verify")
            if verify is not None and (not callable(verify) or not klass.is_write):
                raise ToolDefinitionError(f"verify of {name} must be callable, on a write tool")
            reversal = options.get("reversal", REVERSAL_AUTO)
            if reversal not in (REVERSAL_AUTO, REVERSAL_ASK) and not callable(reversal):
                raise ToolDefinitionError(
                    f"reversal of {name} must be 'auto', 'ask' or a predicate of the step's "
                    f"arguments and result, not {reversal!r}"
                )
            if reversal != REVERSAL_AUTO and compensation is None:
                raise ToolDefinitionError(
                    f"tool {name} has no compensation: there is no reversal to ask about"
                )
            self._add(func, klass, options, DEFAULT_RETRY, offered_default=True)
            return func

        return register

    def compensation(self, **options: Any) -> Callable[[ToolFunction], ToolFunction]:
        """Register a tool that exists to undo others; the agent is not offered it by default.
        ``verify``: how many times the undo made under an idempotency key was applied (for
        ``saga drill``: ``2`` is an undo applied twice)."""
        _refuse_unknown(options, _COMPENSATION_OPTIONS)

        def register(func: ToolFunction) -> ToolFunction:
            if options.get("verify") is not None and not callable(options["verify"]):
                raise ToolDefinitionError(
                    f"verify of {options.get('name', func.__name__)} must be callable"
                )
            self._add(func, None, options, DEFAULT_COMPENSATION_RETRY, offered_default=False)
            return func

        return register

    def get(self, name: str) -> Tool:
        try:
            return self._tools[name]
        except KeyError:
            raise UnknownToolError(f"unknown tool {name!r}; known: {self._known()}") from None

    def offered(self, name: str) -> Tool:
        """The tool the agent asked for, if the agent may call it."""
        tool = self._tools.get(name)
        if tool is not None and tool.offered and tool.tool_class is not None:
            return tool
        callable_ones = f"the agent may call: {self._known(offered=True)}"
        if tool is None:
            raise UnknownToolError(f"unknown tool {name!r}; {callable_ones}")
        why = ""
        if tool.tool_class is None:
            why = " (it only undoes other tools' steps, when a run unwinds)"
        raise ToolNotOfferedError(
            f"tool {name!r} exists but is not offered to agents{why}; {callable_ones}"
        )

    def check_undo(self, undo: Undo) -> dict[str, Any]:
        """Validate an undo against its tool; return its arguments in JSON form."""
        try:
            return self.get(undo.tool).validate(undo.args)
        except (UnknownToolError, InvalidArgumentsError) as exc:
            raise CompensationBuildError(f"unusable undo {undo.tool}: {exc}") from exc

    def __iter__(self) -> Iterator[Tool]:
        return iter(self._tools.values())

    def __len__(self) -> int:
        return len(self._tools)

    def _known(self, offered: bool = False) -> str:
        names = sorted(
            t.name
            for t in self._tools.values()
            if not offered or (t.offered and t.tool_class is not None)
        )
        return ", ".join(names) or "(none)"

    def _add(
        self,
        func: ToolFunction,
        klass: ToolClass | None,
        options: dict[str, Any],
        default_retry: RetryPolicy,
        offered_default: bool,
    ) -> None:
        name = options.get("name", func.__name__)
        if not isinstance(name, str) or not _NAME.match(name):
            raise ToolDefinitionError(f"tool name {name!r} must match {_NAME.pattern}")
        if name in self._tools:
            raise ToolDefinitionError(f"tool {name} is registered twice")
        retry = options.get("retry", default_retry)
        if not isinstance(retry, RetryPolicy):
            raise ToolDefinitionError(f"retry of {name} must be a RetryPolicy")
        schema, wants_context = _schema_of(name, func)
        self._tools[name] = Tool(
            name=name,
            func=func,
            tool_class=klass,
            compensation=options.get("compensation"),
            retry=retry,
            offered=bool(options.get("offered", offered_default)),
            description=options.get("description") or inspect.getdoc(func) or "",
            schema=schema,
            wants_context=wants_context,
            lookup=options.get("lookup"),
            verify=options.get("verify"),
            reversal=options.get("reversal", REVERSAL_AUTO),
        )
        for added in self._watchers:
            added(self._tools[name])


def _problem(error: ErrorDetails) -> str:
    """One problem as a model can act on it: the field, what it should be, what it got."""
    where = ".".join(str(part) for part in error["loc"]) or "(arguments)"
    if error["type"] == "missing":
        return f"{where}: Field required"
    if error["type"] == "extra_forbidden":
        return f"{where}: no such parameter"
    return f"{where}: {error['msg']}, got {_shown(error['input'])}"


_JSON_KINDS: tuple[tuple[type, str], ...] = (
    (bool, "a boolean"),  # before int: a bool is an int in Python
    (int, "an integer"),
    (float, "a number"),
    (str, "a string"),
    (list, "an array"),
    (dict, "an object"),
)


def _shown(value: Any) -> str:
    """A JSON value as the model wrote it, cut short, with its JSON kind."""
    text = json.dumps(value, ensure_ascii=False, default=str)
    if len(text) > 60:
        text = text[:57] + "..."
    kind = next((name for cls, name in _JSON_KINDS if isinstance(value, cls)), "")
    return f"{text} ({kind})" if kind else text


def _refuse_unknown(options: dict[str, Any], known: frozenset[str]) -> None:
    unknown = sorted(set(options) - known)
    if unknown:
        raise ToolDefinitionError(
            f"unknown tool option(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}"
        )


def _schema_of(name: str, func: ToolFunction) -> tuple[type[BaseModel], bool]:
    """A pydantic model of the function's parameters (all but ``ctx``), from its type hints."""
    signature = inspect.signature(func)
    hints = get_type_hints(func)
    fields: dict[str, Any] = {}
    wants_context = False
    for parameter in signature.parameters.values():
        if parameter.name == _CONTEXT_PARAMETER:
            wants_context = True
            continue
        if parameter.kind in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD):
            raise ToolDefinitionError(f"tool {name} must name its parameters (no *args/**kwargs)")
        if parameter.name not in hints:
            raise ToolDefinitionError(f"parameter {parameter.name} of {name} needs a type hint")
        default = ... if parameter.default is parameter.empty else parameter.default
        fields[parameter.name] = (hints[parameter.name], default)
    config = ConfigDict(extra="forbid", strict=True)
    model = create_model(f"{name}_arguments", __config__=config, **fields)
    return model, wants_context
