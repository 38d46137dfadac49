"""One exception type for mistakes a user can fix: the CLI prints its message as one line, exit 2."""

import errno
from pathlib import Path


class UserError(Exception):
    """Bad input, missing data or an unsupported model: the message says what is wrong and what to do."""


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
