"""Files that appear whole or not at all: written to OUT.part, made durable, renamed over
OUT. Used by `kestrel quantize` (apps/gguf_export.py) and the prompt-cache files
(runtime/cache_file.py)."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

from kestrel_cli.core.errors import KestrelError


def fsync_dir(path: Path) -> None:
    """Make a rename in the folder `path` durable (a no-op where the file system cannot)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError:  # a folder on a file system that cannot sync one
        pass
    finally:
        os.close(fd)


def create_part(part: Path, out: Path):
    """OUT.part, new and empty, open for writing. A stale one (a killed run's) or a planted
    link is removed first (a link itself, never the file it names); O_EXCL | O_NOFOLLOW:
    the file is created here, never opened through a link planted meanwhile."""
    try:
        if part.is_symlink() or part.is_file():
            part.unlink()
        fd = os.open(
            part,
            os.O_WRONLY
            | os.O_CREAT
            | os.O_EXCL
            | getattr(os, "O_NOFOLLOW", 0)
            | getattr(os, "O_CLOEXEC", 0),
            0o666,
        )
    except FileExistsError:
        raise KestrelError(
            f"{part} exists and is not a file (or another kestrel process is writing "
            f"{out}); remove it first"
        ) from None
    except OSError as e:
        raise KestrelError(f"{part}: cannot create ({e.strerror or e})") from None
    return os.fdopen(fd, "wb")


def same_file(path: Path, st: os.stat_result) -> bool:
    """Whether `path` (not followed if a link) is still the file `st` was taken of."""
    try:
        now = os.stat(path, follow_symlinks=False)
    except OSError:
        return False
    return (now.st_dev, now.st_ino) == (st.st_dev, st.st_ino)


@contextlib.contextmanager
def atomic_write(out: Path):
    """A new file to write `out`'s contents into: on leaving the block it is fsynced and
    renamed over `out` (then the folder synced), so a crash or power cut leaves the old
    `out` or the whole new one; on an exception it is removed (only if it is still ours,
    never a file swapped in meanwhile) and `out` is untouched."""
    out = Path(out)
    part = out.with_name(out.name + ".part")
    f = made = None
    try:
        f = create_part(part, out)
        made = os.fstat(f.fileno())
        yield f
        if not f.closed:  # (a writer that closes it has synced it: gguf_export.write_gguf)
            f.flush()
            os.fsync(f.fileno())
            f.close()
        if not same_file(part, made):
            raise KestrelError(f"{part} was replaced while being written; {out} not written")
        os.replace(part, out)
        fsync_dir(out.parent)
    except BaseException:
        if f is not None:
            f.close()
        if made is not None and same_file(part, made):
            part.unlink(missing_ok=True)
        raise
