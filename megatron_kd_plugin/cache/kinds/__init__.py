"""The kinds of teacher store, one module each (``store_kind.py``: what a kind owns), and the registry every part
of the store dispatches through: ``format.CacheSpec`` checks a spec with its kind, the writer computes a shard's
rows with it, the reader and the student rows turn stored rows into the loss's typed teacher with it, ``inspect``
and the cache command describe a store with it. A new kind is a module here, one line in :data:`STORE_KINDS`, its
fields in ``CacheSpec`` and its flags in the cache command."""

from megatron_kd_plugin.cache.kinds.draws_store import DrawsStore
from megatron_kd_plugin.cache.kinds.head_draws_store import HeadDrawsStore
from megatron_kd_plugin.cache.kinds.store_kind import StoreKind
from megatron_kd_plugin.cache.kinds.top_k_store import TopKStore
from megatron_kd_plugin.cache.kinds.top_p_store import TopPStore

STORE_KINDS: tuple[StoreKind, ...] = (HeadDrawsStore(), DrawsStore(), TopPStore(), TopKStore())
"""Every kind, the first that holds a spec is its kind (a kind before the kinds it refines)."""
MODES = tuple(sorted({kind.mode for kind in STORE_KINDS}))
"""Every ``CacheSpec.mode``."""


def store_kind(spec) -> StoreKind:
    """The kind of store ``spec`` describes (a ``format.CacheSpec``, or anything with its fields); ValueError for a
    mode no kind has."""
    for kind in STORE_KINDS:
        if kind.holds(spec):
            return kind
    raise ValueError(f"mode={spec.mode!r}; choose one of {list(MODES)}")


def check_kind_fields(spec, kind: StoreKind) -> None:
    """ValueError, in one line, unless ``spec`` is of ``kind``'s mode and leaves every field that only other kinds
    set at the value their stores have everywhere else."""
    if spec.mode != kind.mode:
        described = ", ".join(f"{name}={getattr(spec, name)!r}" for name in kind.described_fields)
        raise ValueError(f"{described} makes a {kind.name} store, of mode {kind.mode!r}, not mode={spec.mode!r}")
    for other in reversed(STORE_KINDS):              # a kind's own fields named by it, not by a kind refining it
        for name, value in other.fields.items():
            if name not in kind.fields and getattr(spec, name) != value:
                raise ValueError(f"{name}={getattr(spec, name)!r} applies to a {other.name} store only, not to a "
                                 f"{kind.name} store (mode {spec.mode!r})")


__all__ = ["MODES", "STORE_KINDS", "StoreKind", "check_kind_fields", "store_kind"]
