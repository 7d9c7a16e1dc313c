"""The docs' examples run as written: every ``python`` block of the README, the integrations
page and the hosted-agents page, against a fake model (no key), a private Redis and a real
worker, from a directory of their own where neither this repository's ``tasks`` nor
``celeryconfig`` can be imported.

A block whose first line is ``# name.py`` is a module (written as that file; the worker
imports the modules); any other block is a script, run in order in a fresh interpreter. The
one thing supplied from outside is ``billing``, the payment system the README's tool calls.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import redis

from saga.testing import RedisServer, WorkerProcess
from saga.testing.fake_models import FakeModel
from tests.conftest import ROOT, service_missing

pytestmark = pytest.mark.timeout(180)

DOCS = ("README.md", "docs/integrations.md", "docs/hosted-agents.md")
_BLOCK = re.compile(r"^```python\n(.*?)^```", re.MULTILINE | re.DOTALL)
_MODULE = re.compile(r"# (\w+)\.py\b")

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
    for code in _BLOCK.findall((ROOT / doc).read_text()):
        named = _MODULE.match(code)
        found.append((named[1] if named else "", code))
    return found


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
            "PYTHONPATH": str(directory),
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
        store = redis.Redis.from_url(url, decode_responses=True)
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
