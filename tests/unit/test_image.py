"""The Dockerfile and its lock file, checked without a Docker engine: the stages, the non-root
user, the dependencies installed from requirements.lock with their hashes, saga installed as a
package (its Lua scripts and migrations inside it), and a lock that covers what pyproject.toml
asks for."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
#: The extras the image carries: every role of compose.yaml runs it.
IMAGE_EXTRAS = ("postgres", "metrics", "flower", "openai", "anthropic", "api")


def _stages() -> dict[str, list[tuple[str, str]]]:
    """Each ``FROM ... AS name`` stage's instructions, as (INSTRUCTION, arguments)."""
    text = re.sub(r"\\\n\s*", " ", (ROOT / "Dockerfile").read_text())
    stages: dict[str, list[tuple[str, str]]] = {}
    current: list[tuple[str, str]] = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        instruction, _, arguments = line.partition(" ")
        if instruction.upper() == "FROM":
            name = arguments.split(" AS ")[-1].strip() if " AS " in arguments else arguments
            current = stages.setdefault(name, [])
        current.append((instruction.upper(), arguments))
    return stages


def _lock() -> dict[str, str]:
    """Package (normalised) → its pinned block in requirements.lock."""
    text = (ROOT / "requirements.lock").read_text()
    blocks = re.split(r"\n(?=[a-z0-9])", text.split("\n", 2)[2] if text.startswith("#") else text)
    return {b.split("==", 1)[0].strip().lower(): b for b in blocks if "==" in b}


def _name(requirement: str) -> str:
    return re.split(r"[\[<>=!~; ]", requirement, maxsplit=1)[0].lower().replace("_", "-")


def test_three_stages_and_the_runtime_runs_as_a_user_not_root() -> None:
    stages = _stages()
    assert list(stages) == ["build", "runtime", "demo"]
    for name in ("runtime", "demo"):
        users = [a for i, a in stages["runtime"] + stages[name] if i == "USER"]
        assert users and users[-1].split(":")[0] not in ("root", "0"), name
    runtime = dict(stages["runtime"])
    assert "useradd --system --uid 10001" in runtime["RUN"]
    # what the runtime takes from the build is the virtualenv, nothing else
    assert [a for i, a in stages["runtime"] if i == "COPY"] == ["--from=build /opt/saga /opt/saga"]


def test_dependencies_come_from_the_lock_with_hashes_and_saga_is_installed_not_editable() -> None:
    build = _stages()["build"]
    copies = [a for i, a in build if i == "COPY"]
    runs = [a for i, a in build if i == "RUN"]
    assert copies[0] == "requirements.lock /tmp/requirements.lock"
    assert "pip install --require-hashes --no-deps -r /tmp/requirements.lock" in runs[1]
    # saga last (the dependency layer is cached across code changes), from its source
    assert "pip install --no-deps --no-build-isolation /src" in runs[2]
    assert "-e " not in " ".join(runs)
    assert "import saga.stack, saga.records.migrations" in runs[2]  # Lua and migrations inside
    assert "COPY saga /src/saga" in [f"COPY {c}" for c in copies]


def test_the_demo_app_is_only_in_the_demo_stage() -> None:
    stages = _stages()
    for name in ("build", "runtime"):
        assert not any("tasks" in a for i, a in stages[name] if i == "COPY"), name
    demo = dict(stages["demo"])
    assert "SAGA_APP=tasks.app:saga" in demo["ENV"]
    assert [a for i, a in stages["demo"] if i == "COPY"] == [
        "--chown=root:root celeryconfig.py /app/",
        "--chown=root:root tasks /app/tasks",
    ]


def test_the_context_sends_only_what_the_image_copies() -> None:
    ignore = (ROOT / ".dockerignore").read_text().split()
    assert ignore[ignore.index("*") :][:1] == ["*"]
    allowed = {line.removeprefix("!").rstrip("/") for line in ignore if line.startswith("!")}
    copied = {"requirements.lock", "pyproject.toml", "README.md", "LICENSE", "saga", "tasks"}
    assert copied | {"celeryconfig.py"} == allowed


def test_the_lock_pins_every_dependency_the_image_needs_with_hashes() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    wanted = list(project["project"]["dependencies"])
    for extra in IMAGE_EXTRAS:
        wanted += project["project"]["optional-dependencies"][extra]
    wanted += project["build-system"]["requires"]
    locked = _lock()
    for requirement in wanted:
        block = locked.get(_name(requirement))
        assert block is not None, f"{requirement} is not in requirements.lock: run `make lock`"
        assert "--hash=sha256:" in block, requirement
    assert all("--hash=sha256:" in block for block in locked.values())
    makefile = (ROOT / "Makefile").read_text()
    assert f"LOCK_EXTRAS := {' '.join(IMAGE_EXTRAS)}" in makefile
    assert "--generate-hashes" in makefile and "-o requirements.lock" in makefile
