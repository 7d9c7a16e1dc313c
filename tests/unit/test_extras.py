"""A missing optional dependency is named in one line, with the extra that brings it and an
exit code of its own (5), never a traceback: the ``saga`` command on a PostgreSQL URL without
psycopg, and Flower's launcher without Flower. Each runs in a fresh interpreter where the
module fails to import as a missing one does."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from saga.cli import ExitCode
from saga.extras import DISTRIBUTION, extra_for, install_hint, missing
from saga.integrations.flower import MISSING_EXTRA

ROOT = Path(__file__).resolve().parents[2]


def _without(tmp_path: Path, module: str) -> str:
    """A PYTHONPATH on which ``import module`` fails with ModuleNotFoundError."""
    package = tmp_path / "shadow" / module
    package.mkdir(parents=True)
    (package / "__init__.py").write_text(
        f"raise ModuleNotFoundError(\"No module named '{module}'\", name='{module}')\n"
    )
    return str(package.parent)


def _run(
    tmp_path: Path, module: str, args: list[str], **env: str
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, *args],
        env={**os.environ, "PYTHONPATH": f"{_without(tmp_path, module)}{os.pathsep}{ROOT}", **env},
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_the_extras_are_the_ones_pyproject_declares() -> None:
    import tomllib

    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = set(declared["optional-dependencies"])
    for module in ("psycopg", "flower", "prometheus_client", "openai", "anthropic", "pydantic_ai"):
        assert extra_for(module) in extras, module
    assert extra_for("psycopg.pq") == "postgres"
    assert missing(ModuleNotFoundError("x", name="no_extra_brings_this")) is None


def test_the_distribution_is_named_as_pyproject_names_it() -> None:
    import tomllib

    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    # ``saga`` on the package index is another project: installing it gives someone else's code
    assert declared["name"] == DISTRIBUTION == "saga-compensation"
    assert install_hint("api") == "pip install 'saga-compensation[api]'"


#: An install spec of the package index's ``saga`` (another project): ``pip install saga``,
#: ``saga[extra]``, ``"saga>=1"``; not ``saga-compensation``, ``saga.cli`` or ``saga serve``.
_WRONG_SPEC = re.compile(r"pip install ['\"]?saga(?![-\w.])|(?<![-\w/.])saga\[")


def test_no_doc_or_message_installs_the_other_projects_saga() -> None:
    texts = [ROOT / "README.md", ROOT / "Dockerfile", ROOT / "compose.yaml", ROOT / "Makefile"]
    texts += [*(ROOT / "docs").rglob("*.md"), *(ROOT / "examples").rglob("*.md")]
    texts += [*(ROOT / "saga").rglob("*.py"), *(ROOT / "examples").rglob("*.py")]
    found = [
        f"{path.relative_to(ROOT)}:{number}: {line.strip()}"
        for path in texts
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if _WRONG_SPEC.search(line)
    ]
    assert found == []
    # and the pattern does catch what it is there to catch
    assert _WRONG_SPEC.search("pip install saga") and _WRONG_SPEC.search("`saga[api]`")
    assert not _WRONG_SPEC.search("pip install 'saga-compensation[api]'")


def test_a_postgresql_url_without_psycopg_names_the_postgres_extra(tmp_path: Path) -> None:
    # Given a PostgreSQL URL and no psycopg
    url = "postgresql+psycopg://saga@127.0.0.1:1/saga"

    # When the escalations are listed
    done = _run(tmp_path, "psycopg", ["-m", "saga.cli", "escalations"], SAGA_DATABASE_URL=url)

    # Then one line says what to install, and the exit code says it is a missing extra
    assert done.returncode == ExitCode.MISSING_EXTRA, done.stderr
    assert "pip install 'saga-compensation[postgres]'" in done.stderr
    assert "Traceback" not in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1


def test_flower_not_installed_names_the_flower_extra(tmp_path: Path) -> None:
    args = ["-m", "saga.integrations.flower", "-A", "tasks.app"]
    done = _run(tmp_path, "flower", args, SAGA_FLOWER_INSECURE_LOCAL="1")
    assert done.returncode == MISSING_EXTRA == ExitCode.MISSING_EXTRA, done.stderr
    assert "pip install 'saga-compensation[flower]'" in done.stderr
    assert "Traceback" not in done.stderr
