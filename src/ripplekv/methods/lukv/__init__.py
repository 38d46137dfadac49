"""LU-KV: budgets from an offline curve (`method`), its solver (`greedy`) and its per-prompt statistics (`oracle`)."""
