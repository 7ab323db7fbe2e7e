"""A copy whose source file stalls midway, for ``test_object_store.py``'s copy killed in the middle of a multipart
upload: ``python -m tests.stalled_copy SOURCE DESTINATION KEY AFTER`` copies SOURCE (a local store) to DESTINATION
while the file KEY stops giving bytes after AFTER of them (a disk that stalls: its upload begun, never finished), the
other files copied as usual; the test kills it. A module of its own so that it starts without the test module's
imports."""

from __future__ import annotations

import sys
import threading

from megatron_kd_plugin.cache.store import storage
from megatron_kd_plugin.cache.store.store_copy import copy_store


def copy_stalled_in(source: str, destination: str, key: str, after: int) -> None:
    """Copies ``source`` to ``destination`` with the source file ``key`` stalling after ``after`` bytes (module
    docstring); never returns while ``key`` is to be copied."""
    read = storage.LocalFolder.read_pieces

    def stalling(self, name: str, piece_bytes: int = storage.PIECE_BYTES):
        given = 0
        for piece in read(self, name, piece_bytes):
            if name == key and given >= after:
                threading.Event().wait()
            given += len(piece)
            yield piece

    storage.LocalFolder.read_pieces = stalling
    copy_store(source, destination)


if __name__ == "__main__":
    copy_stalled_in(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]))
