"""recpipe/compat/: each accessor of a library's private name still finds it in the installed
torch, torchrec and fbgemm-gpu. A failure here names the field or method a release moved:
fix its accessor in recpipe/compat/, nowhere else."""

from __future__ import annotations

import inspect
import re

import pytest
import torch
from torch import nn

from recpipe.compat import fbgemm as compat_fbgemm
from recpipe.compat import torch as compat_torch
from recpipe.compat import torchrec as compat_torchrec


def _sets(cls: type, *fields: str) -> None:
    """Every ``fields`` is assigned as ``self.<field>`` somewhere in ``cls``'s MRO's source."""
    source = "\n".join(inspect.getsource(c) for c in inspect.getmro(cls) if c.__module__.split(".")[0] != "builtins"
                       and c.__module__.split(".")[0] in ("torch", "torchrec", "fbgemm_gpu"))
    missing = [f for f in fields if not re.search(rf"self\.{f}\b\s*[:=]", source)]
    assert missing == [], f"{cls.__module__}.{cls.__qualname__} no longer sets {missing}"


def test_all_to_all_layout_fields():
    from torchrec.distributed.dist_data import KJTAllToAll

    _sets(KJTAllToAll, "_pg", "_splits", "_stagger")
    fake = type("D", (), {"_pg": "pg", "_splits": [1, 2], "_stagger": 1})()
    assert compat_torchrec.all_to_all_layout(fake) == ("pg", [1, 2], 1)


def test_input_dist_fields():
    from torchrec.distributed.embeddingbag import ShardedEmbeddingBagCollection
    from torchrec.distributed.sharding.rw_sharding import RwSparseFeaturesDist

    _sets(ShardedEmbeddingBagCollection, "_has_uninitialized_input_dist", "_input_dists", "_lookups",
          "_sharding_types", "_embedding_shardings")
    _sets(RwSparseFeaturesDist, "_dist")
    module = nn.Module()
    module._has_uninitialized_input_dist = True
    assert compat_torchrec.input_dist_all_to_alls(module) is None


def test_sharding_groups_fields():
    from torchrec.distributed.embedding import ShardedEmbeddingCollection
    from torchrec.distributed.sharding.rw_sharding import BaseRwEmbeddingSharding

    _sets(ShardedEmbeddingCollection, "_sharding_type_to_sharding")
    assert "_get_feature_hash_sizes" in vars(BaseRwEmbeddingSharding)


def test_feature_processor_field():
    from torchrec.distributed.fp_embeddingbag import ShardedFeatureProcessedEmbeddingBagCollection

    # torchrec 1.8 recognises it by its class name; ``_feature_processor`` is the fallback for others
    assert compat_torchrec.has_feature_processor(object.__new__(ShardedFeatureProcessedEmbeddingBagCollection))
    assert not compat_torchrec.has_feature_processor(nn.Module())


def test_lookups_only_modules():
    module = nn.Module()
    assert compat_torchrec.lookups(module) is None
    module._lookups = [nn.Linear(1, 1)]
    assert compat_torchrec.lookups(module) == module._lookups


def test_set_length_per_key_is_what_the_kjt_reports():
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    kjt = KeyedJaggedTensor.from_lengths_sync(["a", "b"], torch.arange(3), torch.tensor([1, 1, 1, 0]))
    compat_torchrec.set_length_per_key(kjt, [7, 5])
    assert kjt.length_per_key() == [7, 5] and kjt.offset_per_key() == [0, 7, 12]


def test_keyed_tensor_key_index():
    from torchrec.sparse.jagged_tensor import KeyedTensor

    kt = KeyedTensor(keys=["a", "b"], length_per_key=[1, 2], values=torch.zeros(2, 3), key_dim=1)
    assert compat_torchrec.keyed_tensor_key_index(kt) == {"a": 0, "b": 1}


def test_fused_splits_fields_are_what_its_wait_reads():
    from torchrec.distributed.embedding_sharding import FusedKJTListSplitsAwaitable

    _sets(FusedKJTListSplitsAwaitable, "_contexts", "_awaitables", "_output_lengths", "_lengths", "_splits_awaitable")
    wait = inspect.getsource(FusedKJTListSplitsAwaitable._wait_impl)
    assert all(f"self.{f}" in wait for f in ("_awaitables", "_lengths", "_splits_awaitable", "_output_lengths"))


def test_ebc_awaitable_parts_and_wait():
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionAwaitable

    _sets(EmbeddingBagCollectionAwaitable, "_awaitables", "_resize_awaitables", "_embedding_names", "_embedding_dims")
    assert "_wait_impl" in vars(EmbeddingBagCollectionAwaitable)
    from torchrec.distributed.types import Awaitable

    assert "_wait_impl()" in inspect.getsource(Awaitable.wait)  # wait() calls the instance's _wait_impl

    class Done(Awaitable):
        def _wait_impl(self):
            return 1

    done = Done()
    compat_torchrec.replace_wait(done, lambda self: 2)
    assert done.wait() == 2


def test_recat_replaced_and_restored():
    from torchrec.distributed import dist_data

    original = compat_torchrec.recat_function()
    assert list(inspect.signature(original).parameters) == [
        "local_split", "num_splits", "stagger", "device", "batch_size_per_rank"]
    assert "_get_recat(" in inspect.getsource(dist_data.KJTAllToAllTensorsAwaitable)  # looked up by name per call
    with compat_torchrec.recat_replaced(len):
        assert dist_data._get_recat is len
    assert dist_data._get_recat is original


def test_reserved_hbm_fields():
    from torchrec.distributed.planner.storage_reservations import HeuristicalStorageReservation

    _sets(HeuristicalStorageReservation, "_dense_storage", "_kjt_storage")
    assert compat_torchrec.reserved_hbm(HeuristicalStorageReservation(percentage=0.15)) == (0, 0)


def test_module_children_and_backward_pre_hooks():
    seq = nn.Sequential(nn.Linear(1, 1))
    seq.register_module("gone", None)
    assert compat_torchrec.module_children(seq) == [seq[0]]
    handle = seq.register_full_backward_pre_hook(lambda m, g: None)
    assert list(compat_torch.backward_pre_hooks(seq)) == [handle.id]


def test_tbe_batch_fields():
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import SplitTableBatchedEmbeddingBagsCodegen

    source = inspect.getsource(SplitTableBatchedEmbeddingBagsCodegen)
    missing = [f for f in compat_fbgemm.TBE_BATCH_FIELDS if not re.search(rf"self\.{f}\s*=", source)]
    assert missing == [], f"FBGEMM's TBE no longer sets {missing}"
