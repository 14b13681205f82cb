"""How the ``fs`` store opens, and gets rid of, whatever it finds at a record path.

The store directory may be shared (NFS, a Kubernetes volume), so what sits at a record
path is not trusted to be a record the store wrote:

- it is opened with ``O_NONBLOCK`` (a FIFO would otherwise block the open, and with it a
  decode instance's whole load, until its deadline) and ``O_NOFOLLOW`` (a symlink could
  point at any file the service may read, ``/dev/zero`` included);
- anything but a regular file is refused after ``fstat``, before a byte is read;
- a regular file larger than the largest valid record is refused without reading it (the
  read is bounded, so a huge file cannot bloat the process).

A refused entry is removed, so that the next save writes a good record in its place
(``os.replace`` swaps a file in over a FIFO or a symlink, but not over a directory).
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
import stat

logger = logging.getLogger(__name__)

_READ_FLAGS = os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC


class Refused(Exception):
    """What sits at a record path is not a record (message says why)."""


def open_record(path: str, max_bytes: int | None) -> tuple[int, os.stat_result] | None:
    """An open descriptor on the regular file at ``path`` and its ``fstat``, or None when
    nothing is there. :class:`Refused` for a symlink, a FIFO, a device, a directory or a
    file over ``max_bytes`` (None: no bound). The caller closes the descriptor."""
    try:
        fd = os.open(path, _READ_FLAGS)
    except FileNotFoundError:
        return None
    except OSError as e:
        if e.errno == errno.ELOOP:  # O_NOFOLLOW met a symlink
            raise Refused("a symbolic link") from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise Refused(f"not a regular file (mode {stat.filemode(st.st_mode)})")
        if max_bytes is not None and st.st_size > max_bytes:
            raise Refused(f"{st.st_size} bytes, larger than any record ({max_bytes})")
        # Reads of a regular file never block; clear the flag so no read is ever short
        # for that reason.
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd, st


def looks_like_record(path: str, max_bytes: int | None) -> os.stat_result | None:
    """``lstat`` of ``path`` when it is a regular file within ``max_bytes``, else None
    (missing, or something a read would refuse). Side-effect free: for lookups."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    if not stat.S_ISREG(st.st_mode) or (max_bytes is not None and st.st_size > max_bytes):
        return None
    return st


def discard(path: str, why: str) -> None:
    """Remove a refused entry (a directory with its contents; symlinks are not followed)."""
    logger.warning("fs store: removing %s: %s", path, why)
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    except IsADirectoryError:
        shutil.rmtree(path, ignore_errors=True)
    except OSError as e:
        if e.errno in (errno.EISDIR, errno.EPERM):  # unlink(2) of a directory on some systems
            shutil.rmtree(path, ignore_errors=True)
        else:
            logger.warning("fs store: cannot remove %s: %s", path, e)
