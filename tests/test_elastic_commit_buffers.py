"""``commlib.elastic.commit_buffers``: a commit's copies go into the buffers of the commit
that falls out, in place (no allocation once ``keep`` commits were made), and are copies
(the live state moving on leaves them be). One process, no MPI."""
from __future__ import annotations

import torch

from commlib.elastic.commit_buffers import ALIGN, Flat, copy_tree, flat_for, layout_of


def tree() -> dict:
    g = torch.Generator().manual_seed(0)
    return {"w": torch.randn(3, 4, generator=g, dtype=torch.float64),
            "step": torch.tensor(5.0),
            "nested": [torch.arange(6, dtype=torch.int32).reshape(2, 3)[:, ::2],  # strided
                       {"lr": 0.1, "betas": (0.9, 0.99)}]}


def leaves(t: object) -> list[torch.Tensor]:
    if isinstance(t, torch.Tensor):
        return [t]
    if isinstance(t, dict):
        return [x for v in t.values() for x in leaves(v)]
    if isinstance(t, (list, tuple)):
        return [x for v in t for x in leaves(v)]
    return []


def test_copy_tree_copies_into_the_buffers_it_is_given():
    live = tree()
    first = copy_tree(live)
    for a, b in zip(leaves(first), leaves(live)):
        assert torch.equal(a, b) and a.data_ptr() != b.data_ptr() and a.is_contiguous()
    with torch.no_grad():  # the live state moves on: the copy stays
        for t in leaves(live):
            t.add_(1)
    assert not torch.equal(first["w"], live["w"]) and first["step"].item() == 5.0
    first["nested"][1]["betas"] = (0.0, 0.0)  # hyper-parameters are copies too
    assert live["nested"][1]["betas"] == (0.9, 0.99)
    pointers = [t.data_ptr() for t in leaves(first)]
    second = copy_tree(live, first)  # in place, into the first copy's tensors
    assert [t.data_ptr() for t in leaves(second)] == pointers
    for a, b in zip(leaves(second), leaves(live)):
        assert torch.equal(a, b)
    assert second["nested"][1] == {"lr": 0.1, "betas": (0.9, 0.99)}


def test_copy_tree_allocates_where_a_buffer_does_not_fit():
    live = tree()
    old = copy_tree(live)
    live["w"] = torch.zeros(5)           # another shape
    live["step"] = live["step"].double()  # another dtype
    new = copy_tree(live, old)
    assert new["w"].data_ptr() != old["w"].data_ptr() and new["w"].shape == (5,)
    assert new["step"].dtype == torch.float64 and new["step"].data_ptr() != \
        old["step"].data_ptr()
    assert new["nested"][0].data_ptr() == old["nested"][0].data_ptr()


def test_flat_lays_tensors_out_in_one_buffer():
    src = [torch.randn(7, dtype=torch.float64), torch.tensor(3.0),
           torch.arange(5, dtype=torch.int16), torch.empty(0)]
    flat = Flat(layout_of(src))
    flat.fill(src)
    for a, b in zip(flat.tensors, src):
        assert torch.equal(a, b) and a.dtype == b.dtype and a.shape == b.shape
        assert a.untyped_storage().data_ptr() == flat.data.untyped_storage().data_ptr()
        assert (a.data_ptr() - flat.data.data_ptr()) % ALIGN == 0
    assert flat.nbytes == 3 * ALIGN  # 56 + 4 + 10 bytes, each padded; the empty one none
    src[0].zero_()
    assert flat.tensors[0].abs().sum() > 0  # a copy, not a view of the source
    assert flat_for(layout_of(src), flat) is flat
    assert flat_for(layout_of(src[:2]), flat) is not flat
