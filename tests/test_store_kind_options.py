"""Every public loss option, for every kind of store, has an effect on the loss or is refused in one line before step
one (issue #40 item 2): a tiny store of each kind (``cache.kinds.STORE_KINDS``), its rows checked by their
``RowKind.check`` and fed to the training loss, one option moved away from the kind's base case at a time. The
cross-tokenizer student's walk is ``tests/test_cross_tokenizer.py``'s."""

import dataclasses

import pytest
import torch

from megatron_kd_plugin.cache import TopKCacheReader, row_kind
from megatron_kd_plugin.cache.kinds import STORE_KINDS
from megatron_kd_plugin.loss import KDLossOptions, topk_kd_loss
from tests.test_cache_store import K, S, V, write

H = 16
STORES = {"top-K": dict(k=K), "top-p": dict(k=K, top_p=0.8, min_k=2),
          "sampled": dict(k=K, mode="sampled", sample_seed=3), "head + draws": dict(k=K, mode="sampled", head=2)}
"""One store of each kind: the write's arguments."""

SLOTS_BASE = dict(tail="ghost", divergence="jsd", jsd_beta=0.5, temperature=1.0, alpha=0.7)
DRAWS_BASE = dict(tail="sampled", alpha=0.7)
BASE = {"top-K": SLOTS_BASE, "top-p": SLOTS_BASE, "sampled": DRAWS_BASE, "head + draws": DRAWS_BASE}
"""Each kind's base case: where every option it takes matters (JSD, so that jsd_beta does; alpha < 1: CE too)."""

WALK = dict(tail="renorm", divergence="reverse_kl", jsd_beta=0.3, temperature=1.5, alpha=0.4, token_weight=0.9,
            impl="dense", mode="grad_in_forward", kernels="torch", chunk_bytes=4 * 3 * V, validate=False,
            mass_tolerance=0.5)
"""One value away from the base case for every ``KDLossOptions`` field."""

COMPUTE = ("impl", "mode", "kernels", "chunk_bytes", "validate", "mass_tolerance")
"""How the loss is computed, not what: moving one keeps the loss."""


@pytest.fixture(scope="module")
def rows(tmp_path_factory):
    """{kind: (rows, its first row's teacher [S, 1, K] in the loss's [s, b] order, labels [S, 1])}."""
    out = {}
    for name, fields in STORES.items():
        path = tmp_path_factory.mktemp("kinds") / f"{name.replace(' ', '_')}.zarr"
        write(path, logprob_codec="fp32", **fields)
        kind = row_kind(TopKCacheReader(path), seq_length=S)
        assert TopKCacheReader(path).spec.kind.name == name
        row = kind.row(0, 0)
        teacher = type(row.teacher)(*(tensor.unsqueeze(1) for tensor in row.teacher))
        out[name] = kind, teacher, row.labels.unsqueeze(1)
    return out


def test_the_walk_covers_every_option_and_every_kind():
    assert set(WALK) == {field.name for field in dataclasses.fields(KDLossOptions)}
    assert set(STORES) == {kind.name for kind in STORE_KINDS}


@pytest.mark.parametrize("name", list(STORES))
def test_every_option_changes_the_loss_or_is_refused_in_one_line(rows, name):
    """The math options move the loss (value and the student's gradient), the compute options keep it, and the rest
    are refused, in one line naming ``kd.<option>`` or its value, by the options' own check or the rows' check
    before step one. A new option, or a kind, fails here until it is placed."""
    kind, teacher, labels = rows[name]
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(S, 1, H, generator=generator, dtype=torch.float64)
    weight = torch.randn(V, H, generator=generator, dtype=torch.float64)

    def loss(**changes):
        options = KDLossOptions(**{**BASE[name], **changes})
        kind.check(options)
        x = hidden.clone().requires_grad_()
        value = topk_kd_loss(x, weight, teacher, labels=labels, options=options).loss_sum
        value.backward()
        return value.detach(), x.grad

    reference, reference_grad = loss()
    for option, value in WALK.items():
        try:
            moved, moved_grad = loss(**{option: value})
        except ValueError as error:
            message = str(error)
            assert "\n" not in message and (option in message or repr(value) in message), (option, message)
            assert option not in COMPUTE, f"{name}: the compute option {option}={value!r} is refused: {message}"
            continue
        if option in COMPUTE:
            torch.testing.assert_close(moved, reference, rtol=1e-9, atol=1e-12, msg=f"{name}: {option}")
            torch.testing.assert_close(moved_grad, reference_grad, rtol=1e-7, atol=1e-10, msg=f"{name}: {option}")
        else:
            assert (moved - reference).abs() > 1e-6, f"{name}: {option}={value!r} is silently ignored"
