"""Progress bar columns shared by the long-running commands, and the ETA clock `ripplekv eval` shows."""

from __future__ import annotations

from rich.progress import ProgressColumn
from rich.text import Text


class Throughput(ProgressColumn):
    """Units finished per second since the bar started (seconds per unit when slower).

    Averaged over the whole run, not rich's recent window: workers finish units in bursts. Units done
    before the bar started (a resumed run) are passed as the task field `resumed` and not counted.
    """

    def __init__(self, unit: str = "sample"):
        super().__init__()
        self.unit = unit

    def render(self, task) -> Text:
        done = task.completed - task.fields.get("resumed", 0)
        if not done or not task.elapsed:
            return Text(f"-- {self.unit}s/s", style="progress.data.speed")
        speed = done / task.elapsed
        text = f"{speed:.2f} {self.unit}s/s" if speed >= 1 else f"{1 / speed:.1f} s/{self.unit}"
        return Text(text, style="progress.data.speed")


class WorkClock:
    """ETA from work done: seconds per prefilled token and per decoded token (max new tokens x variants),
    each measured on this run, times the work left of each kind."""

    def __init__(self, prefill_left: int, decode_left: int):
        import time

        self._now = time.monotonic
        self.left = {"prefill": prefill_left, "decode": decode_left}
        self.done = {"prefill": 0, "decode": 0}
        self.seconds = {"prefill": 0.0, "decode": 0.0}
        self.mark = self._now()

    def advance(self, kind: str, units: int) -> None:
        now = self._now()
        self.seconds[kind] += now - self.mark
        self.mark = now
        self.done[kind] += units
        self.left[kind] = max(0, self.left[kind] - units)

    def eta(self) -> float | None:
        """Seconds left, or None until both kinds of work have been timed once."""
        if any(self.left[k] and not self.done[k] for k in self.left):
            return None
        return sum(self.left[k] * self.seconds[k] / self.done[k] for k in self.left if self.left[k])


def _clock_text(seconds: float | None) -> str:
    if seconds is None:
        return "measuring"
    seconds = int(round(seconds))
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


def _eta_column():
    """Counts down from the last estimate between updates (which come only at phase boundaries)."""
    import time

    from rich.progress import ProgressColumn
    from rich.text import Text

    class EtaColumn(ProgressColumn):
        def render(self, task):
            deadline = task.fields.get("deadline")
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            return Text("ETA " + _clock_text(left))

    return EtaColumn()
