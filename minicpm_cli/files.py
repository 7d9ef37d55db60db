"""Files written whole: under a temporary name in the target's folder, then renamed into place, so
that a reader (or a crash) never sees half a file and a file that was there stays whole until the new
one replaces it. The temporary name is `.<name>.<random>.partial`; the file gets the mode a plain
`open()` would give it (0666 less the umask; `mkstemp` makes 0600)."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def new_file_mode() -> int:
    """0o666 less the process's umask: the mode `open(path, "w")` gives a new file."""
    mask = os.umask(0)
    os.umask(mask)
    return 0o666 & ~mask


def temporary(target: Path) -> tuple[int, str]:
    """(an open descriptor, the name) of a new temporary file beside `target`."""
    return tempfile.mkstemp(prefix=f".{target.name}.", suffix=".partial", dir=target.parent)


def write_whole(path: str | os.PathLike, data: bytes, *, sync: bool = False) -> None:
    """`data` as the file `path`, written under a temporary name and renamed (`sync`: flushed to the
    disk first, for a file that records what is done). An OSError is the caller's to report."""
    target = Path(path)
    fd, tmp = temporary(target)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            if sync:
                f.flush()
                os.fsync(f.fileno())
        os.chmod(tmp, new_file_mode())
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
