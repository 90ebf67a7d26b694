"""Synthetic click log with the Criteo layout and a planted, learnable label model.

Contract: :meth:`SyntheticClickLog.batch` is a pure function of
``(train.seed, rank, split, epoch, index)`` and the :class:`DataSpec`. Each batch draws from its
own ``torch.Generator`` seeded by a hash of those five values, so batch ``k`` is made
without making batches ``0..k-1`` (exact checkpoint resume, DataLoader workers that
each make every n-th batch). The eval split ignores ``epoch``: it is one fixed set,
so evaluations at different epochs are comparable.

Per sample and feature ``f`` (table of ``rows_f`` rows):

* length = 1 + Poisson(mean_pooling_factor_f - 1), so every bag has an id; or, with
  ``data.multi_hot_sizes``, exactly that many ids (fixed shapes, as MLPerf DLRM-DCNv2's
  multi-hot data: every batch holds the same number of ids per feature);
* ids: Zipf(alpha) over ranks ``0..rows_f-1`` (alpha 0 = uniform), sampled by the
  inverse CDF of the continuous density ``x^-alpha`` on ``[0.5, rows_f + 0.5]``
  rounded to the nearest integer (midpoint rule: close to the discrete Zipf law,
  O(1) memory whatever the table size), then mapped through the bijection
  ``rank -> (rank * A_f + C_f) mod rows_f`` (``gcd(A_f, rows_f) = 1``) so hot ids
  are spread over the table (and over row-wise shards);
* dense: ``log1p(floor(exp(N(mu_j, sigma_j))))``, like Criteo's counts after log1p.

Labels come from a planted model fixed by ``train.seed`` alone (identical on every
rank and split): ``logit = signal_scale * (w . standardized(dense) + sum over
features and ids of h_f(id)) / sqrt(D + sum_f mean_f) - bias`` where ``h_f(id)`` in
``[-sqrt 3, sqrt 3)`` is a splitmix64 hash of the id (no weight tables), and
``bias`` is calibrated once so that about 30% of labels are positive. ``label ~
Bernoulli(sigmoid(logit))``.
"""

from __future__ import annotations

import hashlib
import math

import numpy as np
import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from recpipe.config import SyntheticConfig
from recpipe.data.batch import Batch
from recpipe.data.spec import DataSpec

__all__ = ["SyntheticClickLog", "num_synthetic_batches"]

_TARGET_POSITIVE_RATE = 0.30
_CALIBRATION_SAMPLES = 16384


def num_synthetic_batches(syn: SyntheticConfig, *, rank: int, split: str) -> int:
    """Batches of ``split`` that ``rank`` has per epoch (``syn``: ``data.synthetic``)."""
    if split == "eval":
        return syn.num_eval_batches
    if syn.num_batches_per_rank is None:
        return syn.num_batches
    if not 0 <= rank < len(syn.num_batches_per_rank):
        raise ValueError(
            f"rank {rank} has no entry in data.synthetic.num_batches_per_rank "
            f"({len(syn.num_batches_per_rank)} entries)"
        )
    return syn.num_batches_per_rank[rank]


def _seed(*parts: object) -> int:
    """A stable 63-bit seed from ``parts`` (Python's ``hash`` is salted per process)."""
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


def _signed(c: int) -> int:
    """A 64-bit constant as the int64 with the same bits (torch wraps int64 products)."""
    return c - 2**64 if c >= 2**63 else c


_GOLDEN, _MIX1, _MIX2 = (np.uint64(c) for c in (0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB))
# Relative distance from a rounding boundary within which numpy's power is not trusted to
# round as torch's does (both are within a few ulp, 2.2e-16 each, of the exact value).
_POW_MARGIN = 1e-13


def _hash_unit(ids: np.ndarray, keys: np.ndarray) -> np.ndarray:
    """splitmix64(key + id * golden) mapped to float64 in [0, 1); int64 arrays in.

    In numpy's uint64, whose ``>>`` is logical and whose products wrap as torch's int64
    ones do (the same bits): torch has no logical shift of int64 (a shift and a mask
    there), and numpy's in-place operations allocate nothing per step."""
    z = ids.view(np.uint64) * _GOLDEN
    z += keys.view(np.uint64)
    z ^= z >> np.uint64(30)
    z *= _MIX1
    z ^= z >> np.uint64(27)
    z *= _MIX2
    z ^= z >> np.uint64(31)
    z >>= np.uint64(11)
    unit = z.astype(np.float64)  # < 2**53: exact
    unit *= 2.0**-53
    return unit


def _shifted(z: torch.Tensor, bits: int) -> torch.Tensor:
    """``z >> bits`` as a logical shift of the int64's bits (torch's ``>>`` is arithmetic)."""
    return (z >> bits) & ((1 << (64 - bits)) - 1)


def _hash_unit_torch(ids: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """:func:`_hash_unit` in torch's int64 on any device, bit for bit (float64 out)."""
    z = ids * _signed(int(_GOLDEN)) + keys
    z = z ^ _shifted(z, 30)
    z = z * _signed(int(_MIX1))
    z = z ^ _shifted(z, 27)
    z = z * _signed(int(_MIX2))
    z = z ^ _shifted(z, 31)
    return _shifted(z, 11).double() * 2.0**-53


def _zipf_scale(rows: torch.Tensor, alpha: float) -> torch.Tensor | None:
    """Per-table constant of :func:`_zipf_ranks` (float64 [F]); None for the uniform law."""
    if alpha == 0.0:
        return None
    b = 1.0 - alpha
    if abs(b) < 1e-6:  # alpha == 1: the power form degenerates into the log form
        return torch.log((rows + 0.5) / 0.5)
    return (rows + 0.5) ** b - 0.5**b


def _zipf_ranks(u: torch.Tensor, rows: torch.Tensor, alpha: float, scale: torch.Tensor | None = None,
                power=None) -> torch.Tensor:
    """Inverse CDF of density ∝ x^-alpha on [0.5, rows + 0.5] at ``u``, rounded: ranks 0..rows-1.

    ``rows`` (float64) and ``scale`` (``_zipf_scale`` of ``rows``, computed here when
    None) are per element of ``u``. ``power``: how ``floor((c + u * scale) ** e + 0.5)``
    is computed (default :func:`_rounded_power`, CPU tensors only)."""
    if alpha == 0.0:
        return torch.floor(u * rows).long().clamp_(max=rows.long() - 1)
    if scale is None:
        scale = _zipf_scale(rows, alpha)
    b = 1.0 - alpha
    if abs(b) < 1e-6:
        x = 0.5 * torch.exp(u * scale)
        ranks = torch.floor(x + 0.5).long() - 1
    else:
        ranks = (power or _rounded_power)(u, scale, 0.5**b, 1.0 / b)
        ranks -= 1
    return torch.minimum(ranks.clamp_(min=0), rows.long() - 1)


def _rounded_power(u: torch.Tensor, scale: torch.Tensor, c: float, exponent: float) -> torch.Tensor:
    """``floor((c + u * scale) ** exponent + 0.5)`` (int64) as torch's ``pow`` gives it, bit for bit.

    numpy's power (SIMD) costs a fifth of torch's. The two may differ in the last few
    bits, which changes the rounded value only where the power plus 0.5 lies within a
    few ulp of an integer; wherever numpy's lies within ``_POW_MARGIN`` (hundreds of
    ulp) of one, torch's power of the whole tensor decides (about 2 batches in 100 of
    the Criteo-sized tables)."""
    x = u.numpy() * scale.numpy()
    x += c
    np.power(x, exponent, out=x)
    x += 0.5
    gap = np.rint(x)
    gap -= x
    np.abs(gap, out=gap)
    if (gap <= _POW_MARGIN * x).any():
        return torch.floor((c + u * scale) ** exponent + 0.5).long()
    return torch.from_numpy(np.floor(x, out=x).astype(np.int64))


def _torch_rounded_power(u: torch.Tensor, scale: torch.Tensor, c: float, exponent: float) -> torch.Tensor:
    """:func:`_rounded_power` in torch alone, on ``u``'s device."""
    return torch.floor((c + u * scale) ** exponent + 0.5).long()


def _permuted(ranks: torch.Tensor, rows: torch.Tensor, mult: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
    """``(ranks * mult + offset) % rows`` flattened, in place in ``ranks`` (numpy: no
    temporaries; every value is non-negative, so numpy's ``%`` is torch's)."""
    r = ranks.numpy()
    np.multiply(r, mult.numpy(), out=r)
    r += offset.numpy()
    np.remainder(r, rows.numpy(), out=r)
    return ranks.flatten()


def _same_on_every_path(fn, values: torch.Tensor) -> torch.Tensor | None:
    """``fn(values)`` (elementwise) if every element gets the same result whether
    torch's CPU kernel takes its vectorised body (Sleef) or its scalar tail (libm);
    else None. A per-table constant computed once then equals what an elementwise
    computation over any batch would give at any position, whatever the batch size
    and thread count."""
    vector = fn(values.repeat_interleave(64))  # 64 copies: all in the vector body
    scalar = torch.cat([fn(values[i : i + 1]) for i in range(values.numel())])  # one element: the scalar loop
    if torch.equal(vector.view(-1, 64), scalar.unsqueeze(1).expand(-1, 64)):
        return scalar
    return None


class SyntheticClickLog:
    """Deterministic batch factory for one :class:`DataSpec`; cheap to pickle into workers."""

    def __init__(self, spec: DataSpec) -> None:
        syn, seed = spec.synthetic, spec.seed
        self.seed = seed
        self.batch_size = spec.batch_size
        self.keys = list(spec.feature_names)
        self.alpha = syn.zipf_alpha
        rows = list(spec.table_sizes)
        if max(rows) ** 2 >= 2**63:
            raise ValueError(f"tables of {max(rows)} rows overflow the int64 id permutation")
        num_features = len(rows)
        hot = spec.multi_hot_sizes
        pooling = syn.mean_pooling_factors if hot is None else list(hot)
        self.fixed_lengths = None if hot is None else torch.tensor(hot, dtype=torch.int32)
        self.mean_pooling = torch.tensor(
            pooling if isinstance(pooling, list) else [pooling] * num_features, dtype=torch.float64
        )
        self.rows = torch.tensor(rows, dtype=torch.int64)
        # Per-table bijection rank -> (rank * A + C) mod rows; A near rows * golden
        # ratio spreads consecutive ranks far apart.
        mult, offset = [], []
        for f, n in enumerate(rows):
            s = _seed("permutation", seed, f)
            a = max(1, int(n * (0.5 + 0.2 * (s % 1000) / 1000)))
            while math.gcd(a, n) != 1:
                a += 1
            mult.append(a % n if n > 1 else 0)
            offset.append(s % n)
        self.mult = torch.tensor(mult, dtype=torch.int64)
        self.offset = torch.tensor(offset, dtype=torch.int64)
        self.hash_keys = torch.tensor([_signed(_seed("planted", seed, f)) for f in range(num_features)])
        # Per-table integers, repeated per id in one call: rows, mult, offset, hash key.
        self.table_ints = torch.stack([self.rows, self.mult, self.offset, self.hash_keys])
        # The Zipf constant per table, when that is exact (else computed per id, as it was).
        self.zipf_scale = None
        if self.alpha != 0.0:
            self.zipf_scale = _same_on_every_path(lambda r: _zipf_scale(r, self.alpha), self.rows.double())
        # Features whose lengths are drawn (mean > 1); Poisson(0) draws nothing from the generator.
        self.drawn = (self.mean_pooling > 1.0).nonzero().flatten()

        g = torch.Generator().manual_seed(_seed("dense", seed))
        num_dense = spec.num_dense
        self.dense_mu = torch.rand(num_dense, generator=g) * 3.0
        self.dense_sigma = 0.5 + torch.rand(num_dense, generator=g) * 1.5
        self.dense_w = torch.randn(num_dense, generator=g, dtype=torch.float64)
        self.scale = syn.signal_scale / math.sqrt(num_dense + float(self.mean_pooling.sum()))
        self._constants: dict[torch.device, dict[str, torch.Tensor]] = {}  # see _on
        self.bias = 0.0  # planted_logits subtracts it; calibrated on the raw logits
        self.bias = self._calibrate_bias(_seed("calibration", seed))

    def _on(self, device: torch.device) -> dict[str, torch.Tensor]:
        """The per-table and dense constants on ``device`` (made once per device)."""
        constants = self._constants.get(device)
        if constants is None:
            named = {"dense_mu": self.dense_mu, "dense_sigma": self.dense_sigma, "dense_w": self.dense_w,
                     "mean_pooling": self.mean_pooling, "table_ints": self.table_ints, "drawn": self.drawn,
                     "fixed_lengths": self.fixed_lengths, "zipf_scale": self.zipf_scale}
            constants = {k: None if v is None else v.to(device) for k, v in named.items()}
            self._constants[device] = constants
        return constants

    def _features(self, g: torch.Generator, size: int, device: torch.device | None = None
                  ) -> tuple[torch.Tensor, KeyedJaggedTensor, torch.Tensor]:
        """Dense [size, D], the KJT, and each id's table hash key (broadcastable to the
        ids); draws dense, lengths, ids from ``g`` in that order. ``device``: made by
        torch alone on that device (``g`` is a generator of it), see :meth:`batch`."""
        if device is not None:
            return self._device_features(g, size, device)
        z = torch.randn(size, self.dense_mu.numel(), generator=g)
        dense = torch.floor(torch.exp(self.dense_mu + self.dense_sigma * z)).log1p_()
        num_features = len(self.keys)
        lengths = torch.ones(num_features, size, dtype=torch.int32)
        if self.fixed_lengths is not None or self.drawn.numel():  # per-table constants repeated per id
            if self.fixed_lengths is not None:  # data.multi_hot_sizes: no draw
                lengths = self.fixed_lengths.unsqueeze(1).expand(-1, size).contiguous()
            else:
                rates = (self.mean_pooling[self.drawn] - 1.0).unsqueeze(1).expand(-1, size).contiguous()
                lengths[self.drawn] = (torch.poisson(rates, generator=g) + 1).to(torch.int32)
            per_feature = lengths.sum(dim=1)
            total = int(per_feature.sum())
            length_per_key = per_feature.tolist()
            shape: tuple[int, ...] = (total,)
            per_id = lambda t: t.repeat_interleave(per_feature, dim=-1, output_size=total)  # noqa: E731
        else:  # one id per sample and feature: ids as [F, size], per-table constants broadcast
            shape = (num_features, size)
            per_id = lambda t: t.unsqueeze(-1)  # noqa: E731
            length_per_key = [size] * num_features
        rows, mult, offset, hash_keys = per_id(self.table_ints)
        u = torch.rand(shape, generator=g, dtype=torch.float64)  # the same draws for either shape
        scale = None if self.zipf_scale is None else per_id(self.zipf_scale)
        ids = _permuted(_zipf_ranks(u, rows.double(), self.alpha, scale), rows, mult, offset)
        # The ids per key, known here: torchrec reads them from the device otherwise (a
        # host sync in every input dist: ``length_per_key()`` in ``KeyedJaggedTensor.permute``).
        kjt = KeyedJaggedTensor(keys=self.keys, values=ids, lengths=lengths.flatten(), stride=size,
                                length_per_key=length_per_key)
        return dense, kjt, hash_keys

    def _device_features(self, g: torch.Generator, size: int, device: torch.device
                         ) -> tuple[torch.Tensor, KeyedJaggedTensor, torch.Tensor]:
        """:meth:`_features` by torch ops on ``device``: the same laws, ids always flat."""
        c = self._on(device)
        z = torch.randn(size, self.dense_mu.numel(), generator=g, device=device)
        dense = torch.floor(torch.exp(c["dense_mu"] + c["dense_sigma"] * z)).log1p_()
        if c["fixed_lengths"] is not None:  # data.multi_hot_sizes: no draw, the ids per key known here
            lengths = c["fixed_lengths"].unsqueeze(1).expand(-1, size).contiguous()
            per_feature = c["fixed_lengths"].long() * size
            length_per_key = (self.fixed_lengths.long() * size).tolist()
        else:
            lengths = torch.ones(len(self.keys), size, dtype=torch.int32, device=device)
            if self.drawn.numel():
                rates = (c["mean_pooling"][c["drawn"]] - 1.0).unsqueeze(1).expand(-1, size).contiguous()
                lengths[c["drawn"]] = (torch.poisson(rates, generator=g) + 1).to(torch.int32)
            per_feature = lengths.sum(dim=1)
            length_per_key = per_feature.tolist()  # waits for this thread's stream only
        total = sum(length_per_key)
        per_id = lambda t: t.repeat_interleave(per_feature, dim=-1, output_size=total)  # noqa: E731
        rows, mult, offset, hash_keys = per_id(c["table_ints"])
        u = torch.rand(total, generator=g, dtype=torch.float64, device=device)
        scale = None if c["zipf_scale"] is None else per_id(c["zipf_scale"])
        ranks = _zipf_ranks(u, rows.double(), self.alpha, scale, power=_torch_rounded_power)
        ids = (ranks * mult + offset) % rows  # non-negative: torch's % is the modulus
        kjt = KeyedJaggedTensor(keys=self.keys, values=ids, lengths=lengths.flatten(), stride=size,
                                length_per_key=length_per_key)
        return dense, kjt, hash_keys

    def planted_logits(self, dense: torch.Tensor, sparse: KeyedJaggedTensor, hash_keys: torch.Tensor | None = None,
                       device: torch.device | None = None) -> torch.Tensor:
        """The ground-truth click logit of each sample (float64 [B]); ``hash_keys``: each
        id's table key as ``_features`` returns it, if the caller has them. ``device``: by
        torch ops on that device, where ``dense`` and ``sparse`` are."""
        if device is not None:
            return self._device_planted_logits(dense, sparse, hash_keys, device)
        size = dense.shape[0]
        std = (dense.double() - self.dense_mu.double()) / self.dense_sigma.double()
        logit = std @ self.dense_w
        lengths = sparse.lengths().long()
        values = sparse.values()
        if hash_keys is None:
            per_feature = lengths.view(-1, size).sum(dim=1)
            hash_keys = self.hash_keys.repeat_interleave(per_feature, output_size=values.numel())
        # Unit variance: (2 * h - 1) * sqrt(3), in place.
        ids = values.numpy().reshape(-1, size) if hash_keys.dim() == 2 else values.numpy()
        h = _hash_unit(ids, hash_keys.numpy())
        h *= 2.0
        h -= 1.0
        h *= math.sqrt(3.0)
        if hash_keys.dim() == 2:  # [F, 1]: one id per sample and feature
            total = logit.numpy()
            for h_f in h:  # each sample's terms added in feature order, as index_add_ below does
                total += h_f
        else:
            # The sample of each id: samples 0..size-1 once per feature, each repeated by its length.
            sample = torch.arange(size).repeat(lengths.numel() // size).repeat_interleave(lengths, output_size=values.numel())
            logit.index_add_(0, sample, torch.from_numpy(h.reshape(-1)))
        return self.scale * logit - self.bias

    def _device_planted_logits(self, dense: torch.Tensor, sparse: KeyedJaggedTensor, hash_keys: torch.Tensor | None,
                               device: torch.device) -> torch.Tensor:
        """:meth:`planted_logits` by torch ops on ``device``; each sample's id terms summed
        per bag by a segmented sum (no atomics: the same bits every time on a device)."""
        c, size = self._on(device), dense.shape[0]
        std = (dense.double() - c["dense_mu"].double()) / c["dense_sigma"].double()
        logit = std @ c["dense_w"]
        values, lengths = sparse.values(), sparse.lengths()
        if hash_keys is None:
            per_feature = lengths.view(-1, size).sum(dim=1)
            hash_keys = c["table_ints"][3].repeat_interleave(per_feature, output_size=values.numel())
        h = (_hash_unit_torch(values, hash_keys) * 2.0 - 1.0) * math.sqrt(3.0)  # unit variance
        bags = torch.segment_reduce(h, "sum", lengths=lengths, unsafe=True)  # [F * size]
        logit += bags.view(-1, size).sum(dim=0)
        return self.scale * logit - self.bias

    def _calibrate_bias(self, seed: int) -> float:
        """Bias giving a ~30% positive rate, by bisection on a fixed calibration sample."""
        dense, kjt, hash_keys = self._features(torch.Generator().manual_seed(seed), _CALIBRATION_SAMPLES)
        raw = self.planted_logits(dense, kjt, hash_keys)
        lo, hi = -50.0, 50.0
        for _ in range(60):
            mid = 0.5 * (lo + hi)
            if torch.sigmoid(raw - mid).mean() > _TARGET_POSITIVE_RATE:
                lo = mid
            else:
                hi = mid
        return 0.5 * (lo + hi)

    def batch(self, *, rank: int, split: str, epoch: int, index: int, device: torch.device | None = None) -> Batch:
        """Batch ``index`` of ``rank``'s ``split`` stream; eval ignores ``epoch``.

        ``device`` (``data.synthetic.device``): None makes it on the host as described
        above; a device makes it there by torch ops alone, from a generator of that
        device seeded alike, and returns it there. Its random streams are the device's
        own, so its batches are not the host's: the same laws, the same batch for the
        same seed, index and device kind."""
        stream_epoch = 0 if split == "eval" else epoch
        seed = _seed("batch", self.seed, rank, split, stream_epoch, index)
        g = torch.Generator(device=device or "cpu").manual_seed(seed)
        dense, kjt, hash_keys = self._features(g, self.batch_size, device)
        p = torch.sigmoid(self.planted_logits(dense, kjt, hash_keys, device))
        labels = (torch.rand(self.batch_size, generator=g, dtype=torch.float64, device=device) < p).float()
        return Batch(
            dense_features=dense,
            sparse_features=kjt,
            labels=labels,
            weights=torch.ones(self.batch_size, device=device),
        )
