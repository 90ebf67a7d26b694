"""DataSpec: what the data layer's readers and generators need of a config.

The loaders' entry points (``recpipe.data.loader``) take the whole config and build one
``DataSpec`` from it; the readers and the generator below them (``SyntheticClickLog``,
``CriteoTsvReader``, the binary and ``.npy`` datasets, ``Layout``) take the spec, or the
``data`` section, and nothing else. This module imports no torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from recpipe.config import RecpipeConfig, SyntheticConfig

__all__ = ["DataSpec"]


@dataclass(frozen=True)
class DataSpec:
    """The batch shape and the seed a batch is made with.

    ``table_sizes`` are the rows of each sparse feature's table (ids are hashed into
    them), ``multi_hot_sizes`` the fixed ids per feature (None: one id, or drawn lengths
    for synthetic data), ``seed`` is ``train.seed``."""

    batch_size: int
    seed: int
    feature_names: tuple[str, ...]
    table_sizes: tuple[int, ...]
    num_dense: int
    multi_hot_sizes: tuple[int, ...] | None
    synthetic: SyntheticConfig

    @property
    def hotness(self) -> list[int]:
        """Ids per sample of each sparse feature (1 each unless ``data.multi_hot_sizes``)."""
        return list(self.multi_hot_sizes) if self.multi_hot_sizes is not None else [1] * len(self.table_sizes)

    @classmethod
    def from_config(cls, cfg: RecpipeConfig) -> DataSpec:
        d, m = cfg.data, cfg.model
        return cls(
            batch_size=d.batch_size,
            seed=cfg.train.seed,
            feature_names=tuple(m.feature_names),
            table_sizes=tuple(m.num_embeddings_per_feature),
            num_dense=m.num_dense_features,
            multi_hot_sizes=None if d.multi_hot_sizes is None else tuple(d.multi_hot_sizes),
            synthetic=d.synthetic,
        )
