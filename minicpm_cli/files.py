"""Files written whole: under a temporary name in the target's folder, then renamed into place, so
that a reader (or a crash) never sees half a file and a file that was there stays whole until the new
one replaces it. The temporary name is `.<name>.<random>.partial`; the file gets the mode a plain
`open()` would give it (0666 less the umask; `mkstemp` makes 0600)."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from .errors import UsageError


def new_file_mode() -> int:
    """0o666 less the process's umask: the mode `open(path, "w")` gives a new file."""
    mask = os.umask(0)
    os.umask(mask)
    return 0o666 & ~mask


def temporary(target: Path) -> tuple[int, str]:
    """(an open descriptor, the name) of a new temporary file beside `target` (beside what a link
    names)."""
    return tempfile.mkstemp(prefix=f".{target.name}.", suffix=".partial", dir=target.resolve().parent)


def check_writable(directory: str | os.PathLike) -> None:
    """A directory this process can create files in, checked by creating (and removing) one, so that
    a read-only file system, permissions or a missing directory are an error before any work is
    done (`os.access` says yes to root on a read-only mount)."""
    try:
        fd, probe = tempfile.mkstemp(prefix=".minicpm-probe.", dir=directory)
    except OSError as e:
        raise UsageError(f"cannot write in {directory}: {e.strerror or e}") from None
    os.close(fd)
    os.unlink(probe)


def check_target(path: str, option: str) -> None:
    """A file that `option` names, checked before any work: not a directory, in a folder that exists
    and takes a new file (a device or a pipe, such as /dev/stdout, is written in place)."""
    target = Path(path).expanduser()
    if target.is_dir():
        raise UsageError(f"{option} {path} is a directory: name a file in it")
    if target.exists() and not target.is_file():
        return
    parent = target.resolve().parent
    if not parent.is_dir():
        raise UsageError(f"output directory does not exist: {target.parent}")
    check_writable(parent)


def write_whole(path: str | os.PathLike, data: bytes, *, sync: bool = False) -> None:
    """`data` as the file `path`, written under a temporary name and renamed (`sync`: flushed to the
    disk first, for a file that records what is done); a link's target is the file replaced, and a
    device or a pipe (/dev/stdout) is written in place. An OSError is the caller's to report."""
    target = Path(path).expanduser()
    if target.exists() and not target.is_file():
        with open(target, "wb") as f:
            f.write(data)
        return
    target = Path(os.path.realpath(target))
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
