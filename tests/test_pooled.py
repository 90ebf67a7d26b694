"""recpipe.runtime.pooled: a sharded EBC's pooled output kept as its groups' tensors
reads and trains exactly like torchrec's concatenated KeyedTensor."""

import pytest
import torch
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionAwaitable
from torchrec.distributed.types import Awaitable
from torchrec.sparse.jagged_tensor import KeyedTensor

from recpipe.runtime.pooled import GroupedKeyedTensor, grouped

KEYS = ["b", "a", "d", "c", "e"]
DIMS = [2, 3, 1, 4, 2]


def _groups(requires_grad=False):
    torch.manual_seed(0)
    g1 = torch.randn(4, 6, requires_grad=requires_grad)  # b, a, d
    g2 = torch.randn(4, 6, requires_grad=requires_grad)  # c, e
    return g1, g2


def _both(requires_grad=False):
    g1, g2 = _groups(requires_grad)
    plain = KeyedTensor(keys=KEYS, length_per_key=DIMS, values=torch.cat([g1, g2], dim=1), key_dim=1)
    return (g1, g2), plain, GroupedKeyedTensor(KEYS, DIMS, [g1, g2], [3, 2])


def test_reads_like_the_concatenated_keyed_tensor_without_concatenating():
    _, plain, kt = _both()
    assert kt.keys() == plain.keys() and kt.length_per_key() == plain.length_per_key()
    assert kt.offset_per_key() == plain.offset_per_key()
    want = plain.to_dict()
    got = kt.to_dict()
    assert list(got) == list(want)
    for key in KEYS:
        assert torch.equal(got[key], want[key]) and torch.equal(kt[key], plain[key]), key
    assert kt.grouped(), "to_dict and [] must not concatenate"
    assert kt.size_in_bytes() == plain.size_in_bytes()
    assert torch.equal(kt.values(), plain.values())
    assert not kt.grouped()
    assert all(torch.equal(kt.to_dict()[k], want[k]) for k in KEYS)  # plain KeyedTensor from here on


def test_gradients_reach_the_groups_exactly_as_through_torchrecs_cat():
    order = ["a", "c", "e", "b", "d"]  # a model's own feature order

    def loss(kt):
        d = kt.to_dict()
        x = torch.cat([d[k] for k in order], dim=1)
        return (x * torch.arange(x.numel(), dtype=x.dtype).reshape(x.shape)).sum()

    (g1, g2), plain, _ = _both(requires_grad=True)
    loss(plain).backward()
    want = g1.grad.clone(), g2.grad.clone()
    g1.grad = g2.grad = None
    loss(GroupedKeyedTensor(KEYS, DIMS, [g1, g2], [3, 2])).backward()
    assert torch.equal(g1.grad, want[0]) and torch.equal(g2.grad, want[1])
    assert g1.grad.is_contiguous() and g2.grad.is_contiguous()


class _Ready(Awaitable):
    def __init__(self, t):
        super().__init__()
        self.t = t

    def _wait_impl(self):
        return self.t


def test_awaitable_gives_groups_and_falls_back_when_widths_do_not_match():
    g1, g2 = _groups()
    result = grouped(EmbeddingBagCollectionAwaitable([_Ready(g1), _Ready(g2)], DIMS, KEYS))
    kt = result.wait()
    assert isinstance(kt, GroupedKeyedTensor) and kt.grouped()
    assert torch.equal(kt.values(), torch.cat([g1, g2], dim=1))
    odd = grouped(EmbeddingBagCollectionAwaitable([_Ready(g1[:, :4]), _Ready(torch.cat([g1[:, 4:], g2], 1))], DIMS, KEYS))
    kt = odd.wait()
    assert type(kt) is KeyedTensor and torch.equal(kt.values(), torch.cat([g1, g2], dim=1))
    single = EmbeddingBagCollectionAwaitable([_Ready(torch.cat([g1, g2], 1))], DIMS, KEYS)
    assert grouped(single) is single and type(single.wait()) is KeyedTensor


def test_missing_key_raises():
    _, _, kt = _both()
    with pytest.raises(KeyError):
        kt["zz"]
