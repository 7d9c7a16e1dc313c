"""The docs' examples run as written: every ``python`` block of the README, the integrations
page and the hosted-agents page, against a fake model (no key), a private Redis and a real
worker, from a directory of their own where neither this repository's ``tasks`` nor
``celeryconfig`` can be imported.

A block whose first line is ``# name.py`` is a module (written as that file; the worker
imports the modules), unless the doc runs it (``python name.py`` in a shell block); any other
block is a script, run in order in a fresh interpreter. The one thing supplied from outside is
``billing``, the payment system the README's tool calls. saga is this checkout's (the
interpreter's own, as an installed package would be, then the checkout's source).

The README's path for one's own project runs too, as written: its shell lines in a directory of
their own, the worker started by its line, the run by its line.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import redis

from saga.redis_urls import redis_client
from saga.testing import RedisServer, WorkerProcess
from saga.testing.fake_models import FakeModel
from tests.conftest import ROOT, service_missing

pytestmark = pytest.mark.timeout(180)

DOCS = ("README.md", "docs/integrations.md", "docs/hosted-agents.md")
_BLOCK = re.compile(r"^```python\n(.*?)^```", re.MULTILINE | re.DOTALL)
_MODULE = re.compile(r"# (\w+)\.py\b")
_SHELL = re.compile(r"^```sh\n(.*?)^```", re.MULTILINE | re.DOTALL)
_RUN_BY_NAME = re.compile(r"^python (\w+)\.py\b", re.MULTILINE)

BILLING = '''"""Stands in for the payment system the README's tool calls."""
import uuid

_credits = {}


def credit(order_id, amount_cents, idempotency_key):
    new = {"credit_id": f"cr_{uuid.uuid4().hex[:8]}", "amount_cents": amount_cents}
    return _credits.setdefault(idempotency_key, new)


def reverse(credit_id, idempotency_key):
    return {"reversed": credit_id}
'''
#: Imported first by every interpreter of the examples: this repository is not installed.
SITECUSTOMIZE = """import sys


class _NotInstalled:
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in ("tasks", "celeryconfig", "tests"):
            raise ModuleNotFoundError(f"{name} is saga's repository, not an installed package")


sys.meta_path.insert(0, _NotInstalled())
"""
#: The model every example talks to: credit the order, then say so.
SCRIPT = [("issue_credit", {"order_id": 4921, "amount_cents": 250_000}), "Credited order 4921."]


def blocks(doc: str) -> list[tuple[str, str]]:
    """``(module name or "", code)`` of each python block of ``doc``, in order."""
    found = []
    text = (ROOT / doc).read_text()
    scripts = {name for shell in _SHELL.findall(text) for name in _RUN_BY_NAME.findall(shell)}
    for code in _BLOCK.findall(text):
        named = _MODULE.match(code)
        found.append((named[1] if named and named[1] not in scripts else "", code))
    return found


def named_block(doc: str, name: str) -> str:
    """The python block of ``doc`` whose first line names file ``name``."""
    text = (ROOT / doc).read_text()
    [code] = [c for c in _BLOCK.findall(text) if (m := _MODULE.match(c)) and m[1] == name]
    return code


@dataclass
class Examples:
    directory: Path
    env: dict[str, str]
    model: FakeModel
    store: redis.Redis

    def run_script(self, code: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-c", code],
            cwd=self.directory,
            env=self.env,
            capture_output=True,
            text=True,
            timeout=90,
            check=False,
        )

    def run_states(self) -> dict[str, str]:
        keys = self.store.scan_iter(match="saga:{*}:run", count=1000)
        return {str(key): str(self.store.hget(key, "state")) for key in keys}


@pytest.fixture(scope="module")
def examples(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Examples]:
    if shutil.which("redis-server") is None:
        service_missing("redis-server is not installed (Debian: apt-get install redis-server)")
    directory = tmp_path_factory.mktemp("docs-examples")
    (directory / "billing.py").write_text(BILLING)
    (directory / "sitecustomize.py").write_text(SITECUSTOMIZE)
    modules = [name for doc in DOCS for name, code in blocks(doc) if name]
    for doc in DOCS:
        for name, code in blocks(doc):
            if name:
                (directory / f"{name}.py").write_text(code)
    assert modules[0] == "myapp" and len(set(modules)) == len(modules), modules
    model = FakeModel(SCRIPT)
    with RedisServer(directory=directory / "redis") as server, model.serve() as model_url:
        url = f"{server.url}/0"
        inherited = {k: v for k, v in os.environ.items() if not k.startswith(("SAGA_", "PYTHON"))}
        env = {
            **inherited,
            "SAGA_REDIS_URL": url,
            "SAGA_BROKER_URL": url,
            "SAGA_RESULT_BACKEND": url,
            "SAGA_DATABASE_URL": f"sqlite:///{directory / 'saga.db'}",
            "PYTHONPATH": f"{directory}:{ROOT}",
            **model.environ(model_url),
        }
        worker = WorkerProcess(
            "myapp",
            env=env,
            extra_args=["--include", ",".join(modules[1:]), "-Q", "celery,saga.turns"],
            cwd=directory,
            logfile=directory / "worker.log",
        )
        worker.env = env  # exactly these variables, none of this session's
        store = redis_client(url, decode_responses=True)
        with worker:
            yield Examples(directory, env, model, store)
        store.close()


@pytest.mark.parametrize("doc", DOCS)
def test_the_examples_of_a_doc_run_as_written(examples: Examples, doc: str) -> None:
    scripts = [code for name, code in blocks(doc) if not name]
    assert scripts, f"{doc} has no example to run"
    runs_before, asked_before = len(examples.run_states()), len(examples.model.requests)

    # When each example script runs, in order, in a fresh interpreter
    for code in scripts:
        done = examples.run_script(code)
        assert done.returncode == 0, f"{doc}:\n{code}\n{done.stdout}{done.stderr[-3000:]}"

    # Then every run they started ends completed, and the model was asked
    deadline = time.monotonic() + 60
    while any(s in ("running", "unwinding") for s in examples.run_states().values()):
        assert time.monotonic() < deadline, examples.run_states()
        time.sleep(0.2)
    states = examples.run_states()
    assert len(states) > runs_before
    assert set(states.values()) == {"completed"}, states
    if doc != "README.md" or len(scripts) > 1:
        assert len(examples.model.requests) > asked_before


def quick_path() -> list[str]:
    """The shell lines of the README's path for one's own project."""
    text = (ROOT / "README.md").read_text()
    found = _SHELL.search(text, text.index("**In your own project**"))
    assert found is not None, "the README has no shell block for one's own project"
    return [line for line in found[1].splitlines() if line.strip()]


def test_the_readme_quick_path_runs_as_written_in_a_project_of_its_own(
    examples: Examples, tmp_path: Path
) -> None:
    """The README's lines for one's own project, in a directory holding only its two files
    (and ``billing``): ``pip install`` names one distribution (this checkout is what this
    interpreter has installed, so it is not run); the ``export`` line's URL is swapped for a
    private Redis (a database the other examples' worker does not read); the worker is started
    by its line, unchanged, and the run by its line, which prints ``completed``."""
    install, export, worker_line, run_line = quick_path()
    assert re.fullmatch(r"pip install [\w.-]+", install.split("#")[0].strip()), install
    assert export.startswith("export SAGA_REDIS_URL=redis://"), export
    assert worker_line.startswith("celery -A myapp worker"), worker_line
    assert run_line.startswith("python start.py"), run_line
    for name in ("myapp", "start"):
        (tmp_path / f"{name}.py").write_text(named_block("README.md", name))
    (tmp_path / "billing.py").write_text(BILLING)
    (tmp_path / "sitecustomize.py").write_text(SITECUSTOMIZE)
    url = examples.env["SAGA_REDIS_URL"].rsplit("/", 1)[0] + "/3"
    variable, _, _ = export.removeprefix("export ").partition("=")
    env = {
        "PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin",
        "HOME": str(tmp_path),
        "PYTHONPATH": f"{tmp_path}:{ROOT}",
    }
    shell = f"export {variable}={url} && "
    log = (tmp_path / "worker.out").open("wb")
    worker = subprocess.Popen(
        ["bash", "-c", shell + "exec " + worker_line],
        cwd=tmp_path,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        # When the run's line runs (its step waits in the queue until the worker is up)
        done = subprocess.run(
            ["bash", "-c", shell + run_line],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        # Then it completed, on that worker
        output = (tmp_path / "worker.out").read_text(errors="replace")[-3000:]
        assert done.returncode == 0, f"{done.stdout}{done.stderr[-3000:]}\nworker:\n{output}"
        assert done.stdout.strip() == "completed", done.stdout
        assert worker.poll() is None, output
    finally:
        os.killpg(worker.pid, signal.SIGTERM)
        try:
            worker.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(worker.pid, signal.SIGKILL)
            worker.wait(10)
        log.close()


def test_a_tools_worker_runs_with_no_model_key(examples: Examples, tmp_path: Path) -> None:
    """The docs' agent modules make their model client on first use: a worker that only runs
    tools imports them with no API key in its environment, and runs the README's tool."""
    url = examples.env["SAGA_REDIS_URL"].rsplit("/", 1)[0] + "/1"
    env = {k: v for k, v in examples.env.items() if not k.endswith("_API_KEY")}
    env.update(SAGA_REDIS_URL=url, SAGA_BROKER_URL=url, SAGA_RESULT_BACKEND=url)
    modules = [name for doc in DOCS for name, _ in blocks(doc) if name]
    worker = WorkerProcess(
        "myapp",
        env=env,
        extra_args=["--include", ",".join(modules[1:]), "-Q", "celery"],
        cwd=examples.directory,
        logfile=tmp_path / "tools-worker.log",
    )
    worker.env = env  # no key at all, inherited or not
    with worker:
        done = subprocess.run(
            [sys.executable, "-c", named_block("README.md", "start")],
            cwd=examples.directory,
            env=env,
            capture_output=True,
            text=True,
            timeout=90,
            check=False,
        )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "completed"
