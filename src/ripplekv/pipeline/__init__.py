"""The commands' work as plain functions (no Typer): eval, profile, allocate, route, inspect."""
