"""Task metrics (LongBench's official scorer, with parity)."""
