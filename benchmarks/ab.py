"""Two versions of saga side by side: ``benchmarks/peers.py``'s bare and saga runs, from this
tree and from another commit, alternated in one invocation so drift hits both alike.

The other commit is exported (``git archive``) into a temporary directory and its own
``benchmarks/peers.py`` is run there (``--pass normal --without-dbos``; ``--pass durable`` for
Redis syncing every write), so its caller, worker and scripts are that commit's. Each pass is a
process of its own (a saga app binds its Redis at import); passes alternate between the trees
``--repeat`` times, and which tree goes first alternates too (the first of a pair ran slower
here). Reported per mode: the
median over the passes of CPU ms per run (by process), Redis commands per run, runs/s and solo
p50, for each tree, and this tree's figure over the base's. CPU per run and commands per run
are the robust figures on a shared machine; runs/s and latency move between passes.

    python benchmarks/ab.py --base c15e283 --repeat 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def export(commit: str, into: Path) -> Path:
    """The tree of ``commit``, unpacked under ``into``, with this tree's peers virtualenv."""
    tree = into / commit
    tree.mkdir(parents=True)
    archive = into / f"{commit}.tar"
    with archive.open("wb") as out:
        subprocess.run(["git", "archive", commit], cwd=ROOT, stdout=out, check=True)
    with tarfile.open(archive) as tar:
        tar.extractall(tree, filter="data")
    peers_venv = ROOT / ".venv-peers"
    if peers_venv.exists():  # an older peers.py insists on it, even without DBOS
        (tree / ".venv-peers").symlink_to(peers_venv)
    return tree


def one_pass(tree: Path, args: argparse.Namespace) -> dict[str, dict[str, float]]:
    """``tree``'s peers benchmark, one pass, bare and saga: its table (per run)."""
    command = [sys.executable, str(tree / "benchmarks" / "peers.py"), "--pass", args.pass_]
    command += ["--without-dbos", "--json", f"--runs={args.runs}", f"--rounds={args.rounds}"]
    command += [f"--solo={args.solo}", f"--concurrency={args.concurrency}"]
    env = {**os.environ, "PYTHONPATH": str(tree)}
    done = subprocess.run(command, cwd=tree, env=env, stdout=subprocess.PIPE, text=True, check=True)
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def medians(tables: list[dict[str, dict[str, float]]]) -> dict[str, dict[str, float]]:
    return {
        mode: {what: statistics.median(t[mode][what] for t in tables) for what in row}
        for mode, row in tables[0].items()
    }


def render(base: str, figures: dict[str, dict[str, dict[str, float]]]) -> None:
    old, new = figures[base], figures["this tree"]
    for mode, row in new.items():
        print(mode)
        for what, value in row.items():
            before = old[mode][what]
            change = f"{value / before:.2f}x" if before else "-"
            print(f"  {what:<14}{before:>9.2f} -> {value:>9.2f}   {change}")
    for tree, table in figures.items():
        happy = table["saga-happy"]["cpu ms"] / table["bare-happy"]["cpu ms"]
        fail = table["saga-fail"]["cpu ms"] / table["bare-fail"]["cpu ms"]
        print(f"{tree}: saga/bare cpu happy {happy:.2f} fail {fail:.2f}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", required=True, help="the commit to compare against")
    parser.add_argument("--repeat", type=int, default=3, help="passes per tree")
    parser.add_argument("--runs", type=int, default=100, help="runs per round")
    parser.add_argument("--rounds", type=int, default=2, help="interleaved rounds per pass")
    parser.add_argument("--solo", type=int, default=10, help="solo runs per pass")
    parser.add_argument("--concurrency", type=int, default=2, help="Celery worker pool size")
    parser.add_argument("--pass", dest="pass_", choices=["normal", "durable"], default="normal")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="saga-ab-") as tmp:
        trees = {args.base: export(args.base, Path(tmp)), "this tree": ROOT}
        passes: dict[str, list[Any]] = {name: [] for name in trees}
        for i in range(args.repeat):
            order = list(trees.items())
            for name, tree in order if i % 2 == 0 else order[::-1]:
                passes[name].append(one_pass(tree, args))
                print(f"pass {i + 1}/{args.repeat}: {name} done", file=sys.stderr)
    print(
        f"{args.pass_} pass: {args.repeat} alternated passes per tree ({args.rounds} rounds of "
        f"{args.runs} runs each); medians per run, {args.base} -> this tree"
    )
    render(args.base, {name: medians(tables) for name, tables in passes.items()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
