"""Run directories: their files, config, resume logs and atomic writes."""
