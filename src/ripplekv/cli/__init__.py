"""The Typer app: argument parsing and printing only; the work is in ripplekv.pipeline."""


def main() -> None:
    """The `ripplekv` command (imported lazily so `import ripplekv.cli` stays cheap)."""
    from ripplekv.cli.app import main as run

    run()
