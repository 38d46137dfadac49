"""Prefill signals and passes that more than one method reads (a signal one method alone reads lives in its module)."""
