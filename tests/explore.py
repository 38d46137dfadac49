"""`make test-explore`: the property tests with fresh random examples, round after round, for a fixed time.

`make test` draws the same examples on every run (the `ci` profile of tests/conftest.py), so it passes or fails by
the commit. This lane looks for what those examples miss: each round runs every `property` test (every
hypothesis test) once under a new seed, until the time budget is spent (`--seconds`, EXPLORE_SECONDS in the
Makefile; a round cut short by the budget counts as no failure). The first failing round stops the lane with its
seed and the command that replays it; hypothesis prints the falsifying example above it, which then becomes an
`@example(...)` on that test, so that `make test` checks it on every run from then on (README.md, "Tests").
"""

from __future__ import annotations

import argparse
import random
import shlex
import subprocess
import sys
import time


def round_command(seed: int, pytest_args: list[str]) -> list[str]:
    """One round: every property test, stopping at the first failure, under `seed` and the `explore` profile."""
    return [sys.executable, "-m", "pytest", "-m", "property", "-x", "-q", "--hypothesis-profile", "explore",
            f"--hypothesis-seed={seed}", *pytest_args]


def explore(seconds: float, pytest_args: list[str], run=subprocess.run, clock=time.monotonic) -> int:
    """Rounds under fresh seeds until `seconds` have passed: 0 when none failed, else the failing round's code."""
    deadline = clock() + seconds
    rounds = 0
    while clock() < deadline:
        seed = random.SystemRandom().randrange(2**32)  # fresh on purpose: this lane is where chance is wanted
        command = round_command(seed, pytest_args)
        print(f"explore: round {rounds + 1}, seed {seed}", flush=True)
        try:
            code = run(command, timeout=max(deadline - clock(), 1.0)).returncode
        except subprocess.TimeoutExpired:
            print("explore: the time budget ran out during this round (no failure so far in it)")
            break
        if code != 0:
            print(f"explore: FAILED in round {rounds + 1} under seed {seed}. Replay it with:\n  {shlex.join(command)}\n"
                  "then pin the falsifying example printed above as @example(...) on that test (README.md, Tests).")
            return code
        rounds += 1
    print(f"explore: {rounds} full round(s) of fresh examples in {seconds:g} s, no failure")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=600.0, help="time budget in seconds (default 600)")
    parser.add_argument("pytest_args", nargs="*", help="more pytest arguments, e.g. tests/test_budgets.py or -k lava")
    args, more = parser.parse_known_args(argv)  # pytest's own options (-k lava) pass through
    args.pytest_args += more
    if not args.seconds > 0:
        parser.error("--seconds must be a positive number of seconds")
    return explore(args.seconds, args.pytest_args)


if __name__ == "__main__":
    sys.exit(main())
