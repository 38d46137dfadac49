"""The shared machinery every method builds on: the method protocol, spec parsing, budgets, selection, tables, decoding and quantization."""
