"""Progress bar columns shared by the long-running commands."""

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
