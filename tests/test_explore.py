"""The two lanes of the property tests: `make test` draws the same examples every run, `make test-explore` fresh."""

import subprocess

from hypothesis import settings

from tests import explore


def test_the_suite_draws_the_same_examples_on_every_run():
    """The `ci` profile: examples derived from each test's own code, no database replaying an older failure."""
    assert settings.default.derandomize is True and settings.default.database is None
    assert settings.get_profile("explore").derandomize is False


def test_exploring_stops_at_the_first_failing_round_and_names_its_seed(capsys):
    """Rounds under new seeds until one fails; its seed and the replay command are printed."""
    commands, codes = [], iter([0, 0, 1])

    def run(command, timeout):
        commands.append(command)
        return subprocess.CompletedProcess(command, next(codes))

    assert explore.explore(100.0, ["-k", "lava"], run=run, clock=lambda: 0.0) == 1
    seeds = [next(a.split("=")[1] for a in c if a.startswith("--hypothesis-seed=")) for c in commands]
    assert len(commands) == 3 and len(set(seeds)) == 3  # a fresh seed each round
    assert all(c[-2:] == ["-k", "lava"] and "explore" in c and "property" in c for c in commands)
    out = capsys.readouterr().out
    assert f"FAILED in round 3 under seed {seeds[2]}" in out and f"--hypothesis-seed={seeds[2]}" in out


def test_exploring_ends_when_the_time_budget_is_spent(capsys):
    """No failure: rounds run until the budget is spent, and a round the budget cuts short is no failure."""
    now = [0.0]

    def run(command, timeout):
        now[0] += 40.0
        if now[0] > 100.0:
            raise subprocess.TimeoutExpired(command, timeout)
        return subprocess.CompletedProcess(command, 0)

    assert explore.explore(100.0, [], run=run, clock=lambda: now[0]) == 0
    assert "2 full round(s) of fresh examples in 100 s, no failure" in capsys.readouterr().out
