"""saga.agents' public names, and its promise to need no model SDK: it imports none, and
works when none is installed.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import saga.agents

ROOT = Path(__file__).resolve().parents[3]
PACKAGE = ROOT / "saga"

EXPORTED = [
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
SDKS = ("openai", "anthropic", "httpx", "httpx2")
_SDK_IMPORT = re.compile(r"^\s*(import|from)\s+(openai|anthropic)\b", re.MULTILINE)
_CELERY_IMPORT = re.compile(
    r"^\s*(import\s+celery\b|from\s+celery\b|(from|import)\s+saga\.(engine|worker)\b)",
    re.MULTILINE,
)


def _python(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_all_is_pinned() -> None:
    assert saga.agents.__all__ == EXPORTED
    for name in EXPORTED:
        assert hasattr(saga.agents, name), name


def test_importing_saga_agents_imports_no_sdk() -> None:
    """In a fresh interpreter, ``import saga.agents`` loads neither SDK nor their HTTP library."""
    done = _python(
        "import sys, saga.agents; "
        f"print(sorted(m for m in sys.modules if m.split('.')[0] in {SDKS!r}))"
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_saga_agents_works_without_the_sdks_installed() -> None:
    """With openai and anthropic made unimportable, a scripted run renders every format."""
    done = _python(
        "import sys\n"
        "class Gone:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in ('openai', 'anthropic'):\n"
        "            raise ImportError(f'{name} is not installed')\n"
        "sys.meta_path.insert(0, Gone())\n"
        "from saga.agents import *\n"
        "from tasks.tools import tools\n"
        "t = Transcript(); t.add_user('hi')\n"
        "p = ScriptedPolicy([[('get_order', {'order_id': 1})], 'done'])\n"
        "turn = take_turn(p, t, offered_tools(tools))\n"
        "t.add_results([ToolResult(turn.calls[0].id, {'ok': True})])\n"
        "take_turn(p, t, offered_tools(tools))\n"
        "for f in ModelFormat: t.request(f, 'S'); tool_definitions(tools, f)\n"
        "try:\n"
        "    import openai\n"
        "except ImportError:\n"
        "    print('ok')\n"
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"


def test_no_saga_module_imports_an_sdk() -> None:
    """The SDKs are optional extras: nothing in ``saga/`` imports them, inside
    ``saga.agents`` or out."""
    offenders = [
        str(p.relative_to(ROOT)) for p in PACKAGE.rglob("*.py") if _SDK_IMPORT.search(p.read_text())
    ]
    assert offenders == []


def _runtime_source(path: Path) -> str:
    """The module's source without its ``if TYPE_CHECKING:`` blocks (imports for mypy only)."""
    tree = ast.parse(path.read_text())
    kept = [
        node
        for node in tree.body
        if not (isinstance(node, ast.If) and ast.unparse(node.test).endswith("TYPE_CHECKING"))
    ]
    return ast.unparse(ast.Module(body=kept, type_ignores=[]))


def test_saga_agents_needs_no_celery() -> None:
    """No Celery import, and no run-time path to it through the engine or the worker: the
    hosted loop is handed the ``Saga`` (it names the type for mypy only)."""
    modules = sorted((PACKAGE / "agents").rglob("*.py"))
    assert len(modules) >= 8
    for path in modules:
        assert _CELERY_IMPORT.findall(_runtime_source(path)) == [], path.name


def test_the_regex_would_notice_an_sdk_import() -> None:
    assert _SDK_IMPORT.search("def f():\n    import openai\n")
    assert _SDK_IMPORT.search("from anthropic.types import Message\n")
    assert not _SDK_IMPORT.search("# see openai docs\nx = 'import openai'\n")
