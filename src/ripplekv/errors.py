"""One exception type for mistakes a user can fix (the CLI prints its message as one line, exit 2), and one
warning type for what the user should know while the work goes on (`Notice`).

A message may name a setting the user chose (`UserError("... raise {memory_budget} ...", "memory_budget")`):
the libraries do not know how a command line spells it, so it reads as the setting's own name (the Python
API's argument, `memory_budget`) unless the caller phrases it (`phrased`: the CLI writes `--memory-budget`).
"""

import errno
from collections.abc import Callable
from pathlib import Path

CLI_FLAGS = {"budgets": "--budget"}  # settings whose command-line flag is not `--` + their name with dashes


def cli_flag(setting: str) -> str:
    """The command-line flag of a setting a message names: what the CLI and the reproduce pipeline (which passes
    settings to commands as flags) write."""
    return CLI_FLAGS.get(setting, "--" + setting.replace("_", "-"))


def _phrase(message: str, settings, spell: Callable[[str], str] | None) -> str:
    for name in settings:
        message = message.replace("{" + name + "}", spell(name) if spell else name)
    return message


class _Phrased:
    """A message whose `args` are (text, *settings): the names written `{name}` in the text (see the module
    docstring), spelt when the message is shown."""

    def __init__(self, message: str = "", *settings: str):
        super().__init__(message, *settings)

    def phrased(self, spell: Callable[[str], str] | None = None) -> str:
        """The message, each named setting spelt by `spell` (its own name by default)."""
        return _phrase(str(self.args[0]) if self.args else "", self.args[1:], spell)

    def __str__(self) -> str:
        return self.phrased()


class UserError(_Phrased, Exception):
    """Bad input, missing data or an unsupported model: the message says what is wrong and what to do."""


class Notice(_Phrased, UserWarning):
    """What the user should know while the work goes on (the CLI prints it as one `note:` line); the libraries
    warn with it (`warnings.warn`) instead of printing. Named settings as for `UserError`."""


# The errors a long run meets when its disk fills up or was never writable: the user can fix these.
_NO_ROOM = {errno.ENOSPC: "no space is left on its device", errno.EDQUOT: "the disk quota is exceeded",
            errno.EROFS: "its file system is read-only"}
RESUME = "rerun the same command to resume (what is written is kept)"


def write_failure(path: str | Path, err: OSError, then: str = RESUME, elsewhere: str = "pass another --out") -> UserError:
    """One line for an output that could not be written; a full disk, a spent quota or a read-only file
    system also say what to do (free space, or write `elsewhere`, and `then`)."""
    what = _NO_ROOM.get(err.errno)
    if what is None:
        return UserError(f"cannot write {path}: {err.strerror or err}")
    fix = "make it writable" if err.errno == errno.EROFS else "free space there"
    return UserError(f"cannot write {path}: {what}; {fix} or {elsewhere}, then {then}")
