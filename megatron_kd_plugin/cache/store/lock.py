"""The writers' lock of a store: a POSIX record lock (``fcntl.lockf``) on the empty file ``STORE/.writer.lock``.

Every process of a writing run holds it shared from the moment the store is prepared until the run ends, and the
OS drops it when the process dies, whatever kills it. A new run's global rank 0 takes it exclusively before it
creates, resumes, cleans or replaces the store, so a second run on the same store is refused while any process
of the first lives — torch elastic's workers included, which outlive a ``kill -9`` of torchrun itself (they run
in their own sessions). Turning the exclusive lock into a shared one is atomic for POSIX locks, so no other run
can slip in between. POSIX locks belong to a process (a second open in the same process does not conflict, and
closing any descriptor of the file drops the process's lock: only this module opens it) and work over NFS.
"""

from __future__ import annotations

import errno
import fcntl
import os
import pathlib

LOCK_NAME = ".writer.lock"


class WriterLock:
    """The lock file of the store folder ``folder``, opened (created if missing); ``store`` names it in errors."""

    def __init__(self, folder, store=None):
        self.path = pathlib.Path(folder) / LOCK_NAME
        self.store = pathlib.Path(folder) if store is None else pathlib.Path(store)
        self._fd: int | None = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)

    def exclusive(self) -> "WriterLock":
        """Takes the lock alone; ValueError (and the file closed) while another process holds it."""
        self._take(fcntl.LOCK_EX)
        return self

    def shared(self) -> "WriterLock":
        """Takes (or turns an exclusive lock of this process into) a shared lock; ValueError as :meth:`exclusive`."""
        self._take(fcntl.LOCK_SH)
        return self

    def _take(self, kind: int) -> None:
        try:
            fcntl.lockf(self._fd, kind | fcntl.LOCK_NB)
        except OSError as exc:
            if exc.errno not in (errno.EACCES, errno.EAGAIN):
                raise
            self.release()
            raise ValueError(f"another run is writing {self.store}: a live process holds the lock {self.path} "
                             f"(`fuser -v {self.path}` lists it; killing torchrun alone leaves its workers running)"
                             "; wait for that run to end or stop all its processes, then rerun") from exc

    def check(self) -> None:
        """Nothing: a POSIX lock cannot be lost while its process lives (``lease.WriterLease.check`` can)."""

    def release(self) -> None:
        """Closes the file, which drops this process's lock."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> "WriterLock":
        return self

    def __exit__(self, *exc) -> None:
        self.release()
