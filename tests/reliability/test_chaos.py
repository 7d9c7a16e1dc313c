"""The randomised chaos run, inside the test suite.

``SAGA_CHAOS_RUNS`` (default 40) runs of 4-6 steps with random kill points across two
workers, seeded by ``SAGA_CHAOS_SEED`` (default 1): no invariant may break. A few of them
(``SAGA_CHAOS_HOSTED_SHARE``, default 0.1: a few of seed 1's 40) are hosted agent runs
on a turn worker that the plans kill mid-turn; ``make chaos`` runs a quarter of them hosted.
The run is a subprocess (``python -m tests.reliability.chaos``) that owns its Redis and
workers and stops them itself, also when it is told to stop (SIGTERM) on a timeout.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT, service_missing

RUNS = int(os.environ.get("SAGA_CHAOS_RUNS", "40"))
SEED = int(os.environ.get("SAGA_CHAOS_SEED", "1"))
HOSTED_SHARE = float(os.environ.get("SAGA_CHAOS_HOSTED_SHARE", "0.1"))
#: 40 runs take about a minute on two cores; this bounds a run that hangs.
#: The long profile is ``make chaos RUNS=1000``.
BUDGET = 420


@pytest.mark.timeout(BUDGET + 60)
def test_chaos_run_breaks_no_invariant(tmp_path: Path) -> None:
    if shutil.which("redis-server") is None:
        service_missing("redis-server is not installed (Debian: apt-get install redis-server)")
    report = tmp_path / "chaos.json"
    command = [sys.executable, "-m", "tests.reliability.chaos"]
    command += ["--runs", str(RUNS), "--seed", str(SEED), "--json", str(report)]
    command += ["--hosted-share", str(HOSTED_SHARE)]
    process = subprocess.Popen(
        command,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    try:
        output, _ = process.communicate(timeout=BUDGET)
    except subprocess.TimeoutExpired:
        process.send_signal(signal.SIGTERM)  # it stops its workers and Redis on the way out
        try:
            output, _ = process.communicate(timeout=45)
        except subprocess.TimeoutExpired:
            process.kill()
            output, _ = process.communicate()
        pytest.fail(f"the chaos run took more than {BUDGET}s:\n{output[-5000:]}")
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    print(output)

    # Then its last line says it, its figures agree, and nothing broke
    last = output.strip().splitlines()[-1]
    match = re.fullmatch(r"chaos: (\d+) runs, (\d+) kills, (\d+) violations", last)
    assert match, f"unexpected last line {last!r}:\n{output[-5000:]}"
    figures = json.loads(report.read_text())
    assert figures["violations"] == [], "\n".join(figures["violations"])
    assert int(match.group(3)) == 0 and process.returncode == 0
    assert int(match.group(1)) == RUNS == sum(figures["states"].values())
    assert int(match.group(2)) == figures["kills"] > 0
    assert figures["figures"]["undo_applications"] > 0
    assert figures["figures"]["compensations_done"] > 0
    assert set(figures["states"]) <= {"completed", "compensated", "escalated"}
    if HOSTED_SHARE >= 0.03:
        assert figures["figures"]["hosted"]["runs"] > 0
