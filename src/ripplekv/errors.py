"""One exception type for mistakes a user can fix: the CLI prints its message as one line, exit 2."""


class UserError(Exception):
    """Bad input, missing data or an unsupported model: the message says what is wrong and what to do."""
