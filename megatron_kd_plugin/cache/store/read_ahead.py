"""Read-ahead of a store on object storage: the samples a dataset will read next, fetched and checked by a pool of
threads while the current ones are trained on.

A request to an object store costs ~1 ms of latency however small, where a local ``pread`` costs microseconds, so a
reader that fetches one chunk at a time waits most of the time (``tools/bench_object_store.py``). :class:`ReadAhead`
takes the samples the dataset says come next (``KDRows`` hints the samples of its next rows, a pure function of
the row number), sorted so that neighbours share requests, reads them in batches of :data:`BATCH` (``records.SampleReader.read_many``: one request per
array and shard for neighbouring chunks) on :data:`THREADS` threads (the client and the codecs release the GIL),
and keeps at most :data:`AHEAD_TOKENS` tokens of samples read or in flight. A sample asked for that was not hinted is read at once.
Every read is checked exactly as without it (CRC32C, records, ids); an error surfaces where the sample is asked for.
"""

from __future__ import annotations

import collections
import concurrent.futures
import threading

BATCH = 32
"""Samples fetched by one task."""
THREADS = 8
"""Fetching threads."""
AHEAD_TOKENS = 1 << 18
"""Tokens of samples read or in flight at most (512 samples at S = 512, ~50 MB at K = 100)."""


class ReadAhead:
    """Read-ahead over ``samples`` (a ``records.SampleReader``)."""

    def __init__(self, samples, names=None):
        self.samples, self.names = samples, names
        self.limit = max(2 * BATCH, AHEAD_TOKENS // samples.spec.seq_length)
        self._pool = concurrent.futures.ThreadPoolExecutor(THREADS, thread_name_prefix="kd-read-ahead")
        self._pending: collections.OrderedDict[int, tuple[concurrent.futures.Future, int]] = collections.OrderedDict()
        self._lock = threading.Lock()

    def hint(self, samples) -> None:
        """The samples to be read next, in order (those already pending are skipped)."""
        with self._lock:
            fresh = list(dict.fromkeys(int(s) for s in samples if int(s) not in self._pending))
            fresh = sorted(fresh[:max(0, self.limit - len(self._pending))])   # neighbours together: fewer requests
            for begin in range(0, len(fresh), BATCH):
                batch = fresh[begin:begin + BATCH]
                future = self._pool.submit(self.samples.read_many, batch, self.names)
                for position, sample in enumerate(batch):
                    self._pending[sample] = (future, position)

    def read(self, sample: int, names=None) -> dict:
        """Sample ``sample``'s arrays (``names``: only those), from the read-ahead when hinted."""
        with self._lock:
            found = self._pending.pop(int(sample), None)
        if found is None:
            return self.samples.read(sample, names)
        future, position = found
        arrays = future.result()[position]
        return arrays if names is None else {name: arrays[name] for name in names if name in arrays}

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
