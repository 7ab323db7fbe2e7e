"""The writers' lock of a store on object storage: a lease object ``PREFIX/.writer.lock`` taken and renewed by
conditional writes (the counterpart of ``lock.py``'s POSIX lock on a local disk, same methods).

Taking it: a PUT with If-None-Match: * creates the object only where none exists; an existing lease is taken over
(a PUT with If-Match: its ETag, so two runs cannot both take it) only when it has expired (not renewed for
:data:`LEASE_SECONDS`: its Last-Modified, by the server's clock, against this host's clock) or when its holder is a
process of this host that no longer lives (a run killed with SIGKILL is resumed at once on the same machine, as
with the POSIX lock). Holding it: a thread renews it every :data:`LEASE_SECONDS` / 4 with If-Match: the ETag of its
own last write; a renewal that fails means another run took the lease (after this one stalled past its expiry).
Releasing it: deleting the object.

Only the run's global rank 0 holds the lease (a rank that dies ends the run's collectives, and rank 0 dying stops
the renewals, so the lease expires); every other rank's handle (:meth:`shared`) reads the holder id of rank 0's
lease when it joins. :meth:`check` runs before each shard is written, on every writing rank: it fails once a
renewal failed or the lease object names another holder (one GET), so a run that lost its lease writes no further
shard and never marks the store complete.

Without conditional writes (the client told not to send them, ``AWS_CONDITIONAL_PUT=disabled``: the setting for a
server that rejects them; or a server that ignores them: a second If-None-Match create of the lease succeeds) the
server cannot tell two runs apart at the moment they take the lease: the writer then says so in one line, refuses
to start while a lease object that has not expired exists, and renews by reading the holder id before overwriting
it. Two runs starting within the same moment are then both let in, and each stops at its next :meth:`check` once
the lease object names the other.
"""

from __future__ import annotations

import datetime
import json
import os
import socket
import threading
import time
import uuid

from megatron_kd_plugin.cache.store import storage
from megatron_kd_plugin.cache.store.lock import LOCK_NAME

LEASE_SECONDS = float(os.environ.get("KD_STORE_LEASE_SECONDS", 60))
"""How long a lease lives without renewal (the ``KD_STORE_LEASE_SECONDS`` variable; default 60 s)."""


class WriterLease:
    """The lease of the store at ``prefix`` (a ``storage.ObjectPrefix``)."""

    def __init__(self, prefix: storage.ObjectPrefix):
        self.prefix = prefix
        self.holder = {"id": uuid.uuid4().hex, "host": socket.gethostname(), "pid": os.getpid()}
        self._held_by: str | None = None
        """The holder id the lease object names while this run holds it (its own on rank 0, rank 0's elsewhere)."""
        self._etag: str | None = None
        self._conditional = True
        self._lost: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def exclusive(self) -> "WriterLease":
        """Takes the lease and keeps it renewed; ValueError naming the holder while another run holds it."""
        body = json.dumps(self.holder).encode()
        self.probe()                                     # the only guard where the server ignores conditions
        try:
            self._etag = self.prefix.put(LOCK_NAME, body, mode="create")
            self._refuse_ignored_conditions(body)
        except FileExistsError:
            self._etag = self._take_over(body)
        except storage.ConditionsUnsupported as exc:
            print(f"[cache] {exc}: a second run starting on {self.prefix} at the same moment is not refused (each "
                  "run stops before its next shard once the lease names the other)", flush=True)
            self._conditional = False
            self.prefix.put(LOCK_NAME, body)
        self._held_by = self.holder["id"]
        self._thread = threading.Thread(target=self._renew, daemon=True, name="kd-store-lease")
        self._thread.start()
        return self

    def probe(self) -> None:
        """ValueError while another run holds a live lease on the store (taking nothing)."""
        head = self.prefix.head(LOCK_NAME)
        if head is not None and not self._expired(head) and not self._dead_here():
            self._refuse_live(head)

    def shared(self) -> "WriterLease":
        """This rank's handle: the lease itself on the rank that took it; on the others a handle that knows the
        holder id of the lease rank 0 took (read from the lease object), for :meth:`check`."""
        if self._held_by is None:
            self._held_by = self._holder_of().get("id")
            if self._held_by is None:
                raise ValueError(self._lost_line("its lease object was deleted"))
        return self

    def check(self) -> None:
        """ValueError when this run no longer holds the lease: a renewal failed or the lease object names another
        holder, or none (one GET)."""
        if self._lost is None:
            self._check_holder()
        if self._lost:
            raise ValueError(self._lost)

    def release(self) -> None:
        """Stops renewing and deletes the lease (only while this run still holds it)."""
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None
            if not self._lost:
                try:
                    self.prefix.delete(LOCK_NAME)
                except (ValueError, OSError):
                    pass

    def _take_over(self, body: bytes) -> str:
        head = self.prefix.head(LOCK_NAME)
        if head is None:                                 # released in between: take it fresh
            return self.prefix.put(LOCK_NAME, body, mode="create")
        if not self._expired(head) and not self._dead_here():
            self._refuse_live(head)
        try:
            return self.prefix.put(LOCK_NAME, body, mode=head["e_tag"])
        except storage.ConditionFailed:
            self._refuse_live(self.prefix.head(LOCK_NAME))

    def _refuse_ignored_conditions(self, body: bytes) -> None:
        """ConditionsUnsupported when the server ignores If-None-Match: a second create of the lease just taken
        succeeds (it rewrites the same bytes)."""
        try:
            self.prefix.put(LOCK_NAME, body, mode="create")
        except FileExistsError:
            return
        raise storage.ConditionsUnsupported(f"{self.prefix}: the object store ignores conditional writes (a second "
                                            f"If-None-Match create of {self.prefix.name(LOCK_NAME)} succeeded)")

    def _holder_of(self) -> dict:
        """The holder the lease object names ({} when there is none or it is not a holder's JSON)."""
        try:
            found = json.loads(self.prefix.get(LOCK_NAME))
            return found if isinstance(found, dict) else {}
        except (FileNotFoundError, json.JSONDecodeError, UnicodeDecodeError):
            return {}

    def _check_holder(self) -> None:
        """Marks the lease lost when its object names a holder other than this run's (or none)."""
        holder = self._holder_of()
        if holder.get("id") != self._held_by:
            self._lost = self._lost_line(f"process {holder.get('pid', '?')} on {holder.get('host', '?')} holds it "
                                         "now" if holder else "its lease object was deleted or overwritten")

    def _expired(self, head) -> bool:
        age = (datetime.datetime.now(datetime.timezone.utc) - head["last_modified"]).total_seconds()
        return age > LEASE_SECONDS

    def _dead_here(self) -> bool:
        holder = self._holder_of()
        if holder.get("host") != self.holder["host"] or not isinstance(holder.get("pid"), int):
            return False
        try:
            os.kill(holder["pid"], 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            return False
        return False

    def _refuse_live(self, head) -> None:
        if head is None:
            return
        holder = self._holder_of()
        age = (datetime.datetime.now(datetime.timezone.utc) - head["last_modified"]).total_seconds()
        raise ValueError(f"another run is writing {self.prefix}: its lease {self.prefix.name(LOCK_NAME)} (process "
                         f"{holder.get('pid', '?')} on {holder.get('host', '?')}) was renewed {age:.0f} s ago and "
                         f"expires {max(0.0, LEASE_SECONDS - age):.0f} s after its last renewal; wait for that run to "
                         "end or stop it, then rerun")

    def _lost_line(self, why: str) -> str:
        return (f"{self.prefix}: this run lost its writers' lease {self.prefix.name(LOCK_NAME)} ({why}); the store "
                "stays incomplete: rerun the cache command once that run ends")

    def _renew(self) -> None:
        """Renews every LEASE_SECONDS / 4: If-Match on the ETag of its own last write, or, without conditional
        writes, after reading that the lease object still names this run."""
        body = json.dumps(self.holder).encode()
        while not self._stop.wait(LEASE_SECONDS / 4):
            try:
                if not self._conditional:
                    self._check_holder()
                    if self._lost:
                        return
                self._etag = self.prefix.put(LOCK_NAME, body, mode=self._etag if self._conditional else None)
            except storage.ConditionFailed:
                self._lost = self._lost_line(f"not renewed for {LEASE_SECONDS:.0f} s, another run took it over")
                return
            except (ValueError, OSError):
                time.sleep(1)                           # a transient failure: the next renewal retries


def writer_lock(output, *, exclusive: bool):
    """The writers' lock of the store at ``output``: a ``lock.WriterLock`` on a local disk, a :class:`WriterLease`
    on object storage; taken ``exclusive`` (rank 0) or shared (the other ranks)."""
    if isinstance(output, storage.ObjectPrefix):
        lease = WriterLease(output)
        return lease.exclusive() if exclusive else lease.shared()
    from megatron_kd_plugin.cache.store.lock import WriterLock

    lock = WriterLock(output)
    return lock.exclusive() if exclusive else lock.shared()
