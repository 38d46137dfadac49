"""Progress bar columns shared by the long-running commands."""

from __future__ import annotations

from rich.progress import ProgressColumn
from rich.text import Text


class Throughput(ProgressColumn):
    """Finished units per second (or seconds per unit when slower), over rich's recent window."""

    def __init__(self, unit: str = "sample"):
        super().__init__()
        self.unit = unit

    def render(self, task) -> Text:
        speed = task.finished_speed or task.speed
        if not speed:
            return Text(f"-- {self.unit}s/s", style="progress.data.speed")
        text = f"{speed:.2f} {self.unit}s/s" if speed >= 1 else f"{1 / speed:.1f} s/{self.unit}"
        return Text(text, style="progress.data.speed")
