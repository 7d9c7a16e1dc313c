"""The testing kit as a user meets it: pytest run on a project of its own (its app, its tools,
its tests using only the plugin's fixtures), in a subprocess, from that project's directory."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import redis

from saga.testing import RedisServer, WorkerProcess
from tests.conftest import MACHINE_REDIS, ROOT, TEST_STORE, service_missing

EXAMPLE = ROOT / "examples" / "testing_kit"

pytestmark = pytest.mark.timeout(180)


def pytest_in(directory: Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    """``python -m pytest ARGS`` in ``directory``, with none of this session's saga settings."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("SAGA_", "PYTEST_"))}
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args],
        cwd=directory,
        env={**clean, **env},
        capture_output=True,
        text=True,
        timeout=150,
        check=False,
    )


def test_the_example_project_passes_its_own_tests_with_only_the_plugin() -> None:
    if shutil.which("redis-server") is None:
        service_missing("redis-server is not installed (Debian: apt-get install redis-server)")
    # When pytest runs in the example project (the plugin starts its Redis and its worker)
    done = pytest_in(EXAMPLE)

    # Then every one of its tests passed, faults and fake model included
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert "9 passed" in done.stdout


def test_a_given_redis_is_used_at_its_database_and_a_missing_app_is_explained(
    redis_url: str, tmp_path: Path
) -> None:
    # Given a project that asks for the Redis, and one test that wants an app it never named
    (tmp_path / "test_url.py").write_text(
        "def test_url(saga_redis_url):\n    assert saga_redis_url.endswith('/14'), saga_redis_url\n"
    )
    (tmp_path / "test_app.py").write_text("def test_app(saga_app):\n    pass\n")

    # When its tests run with a Redis named in the environment
    # (a cluster has database 0 only: there, the machine's Redis is the one named)
    base = MACHINE_REDIS if TEST_STORE == "cluster" else redis_url.rsplit("/", 1)[0]
    done = pytest_in(tmp_path, "-rA", "--saga-redis-db", "14", SAGA_TEST_REDIS_URL=base)

    # Then that Redis's database 14 is the one handed out, and the app's absence is explained
    assert "1 passed, 1 error" in done.stdout, done.stdout + done.stderr
    assert "PASSED test_url.py::test_url" in done.stdout
    assert "set saga_app = module:attr" in done.stdout


def test_loading_the_plugin_imports_nothing_beyond_saga_itself() -> None:
    # The plugin is loaded by every pytest run where saga is installed: it must add nothing
    # (no fake model, no HTTP library, no process helpers) until a test asks for a fixture.
    script = (
        "import sys, pytest, saga; before = set(sys.modules); import saga.testing.plugin; "
        "print(sorted(set(sys.modules) - before))"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=True
    )
    # the package's own __init__ (its names load on first use) and the plugin, nothing else
    assert done.stdout.strip() == "['saga.testing', 'saga.testing.plugin']"


def test_a_server_and_a_worker_run_under_the_command_they_are_wrapped_in(tmp_path: Path) -> None:
    if shutil.which("redis-server") is None:
        service_missing("redis-server is not installed (Debian: apt-get install redis-server)")

    # Given a wrapper command (as valgrind or strace would be) that notes its process id in a
    # file named by the wrapped program, then becomes that program
    def wrapper(name: str) -> list[str]:
        note = f'echo $$ > {tmp_path / name}; exec "$@"'
        return ["sh", "-c", note, "wrapper"]

    # When a Redis and a worker start under it
    with RedisServer(wrapper=wrapper("redis")) as server:
        env = {
            "SAGA_REDIS_URL": server.url,
            "SAGA_BROKER_URL": server.url,
            "SAGA_RESULT_BACKEND": server.url,
            "SAGA_DEMO_DATA": str(tmp_path / "data"),
            "SAGA_DATABASE_URL": f"sqlite:///{tmp_path / 'records.db'}",
        }
        worker = WorkerProcess(
            "tasks.app", env=env, concurrency=1, cwd=ROOT, wrapper=wrapper("worker")
        )
        with worker:
            # Then each is the wrapped command's process, and it came up: Redis answers and
            # the worker said it is ready
            assert server.process is not None
            assert (tmp_path / "redis").read_text().strip() == str(server.process.pid)
            assert (tmp_path / "worker").read_text().strip() == str(worker.pid)
            with redis.Redis.from_url(server.url) as client:
                assert client.ping()
