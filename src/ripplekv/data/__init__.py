"""Package data: the official LongBench tables and the allocations shipped for the bundled model."""
