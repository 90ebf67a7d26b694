"""Weak-scaling model: per-rank all-to-all volume and the step's hardware bound at
W GPUs (:func:`predict_scaling`). A model, not a measurement: a prediction to check
against ``recpipe bench`` on W GPUs (docs/scaling.md says which numbers to compare).

Weak scaling: every rank keeps ``data.batch_size`` (B) samples, the global batch is
W * B. Shards are placed by :func:`recpipe.planner.inputs.inputs_from_config` at each W.
Per table t (pooling factor pf, dim D), per rank r, bytes that *cross the link* (the
share a rank keeps for itself never leaves it):

* input KJT all-to-all (int64 values, int32 lengths; recpipe's KJTs carry no
  per-id weights). Each rank sends, to every rank s holding a shard of t, B lengths
  and its ids for s: ``B * (4 + 8 * pf * f_s)`` with ``f_s`` = 1 for TW (the owner)
  and CW (every column shard's rank), ``rows_s / rows`` for RW (ids are spread over
  the table: recpipe's synthetic data permutes Zipf ranks over the rows). DP: none.
  So s receives that from each of the W - 1 others.
* forward output dist of pooled embeddings, ``p`` bytes per value
  (``sharding.comm_precision.forward``: 4 fp32, 2 fp16 / bf16). TW/CW shard of c
  columns on s: s sends ``B * c * p`` to each of the W - 1 others, each receives it
  from s. RW: reduce-scatter of the [W*B, D] partial sums; ring: every rank sends
  and receives ``(W - 1) * B * D * p``. Sequence tables send a row per id.
* backward: the gradients of the same tensors, the other way (sent <-> received),
  at ``sharding.comm_precision.backward``.
* DDP all-reduce of dense gradients (+ data-parallel tables), ring:
  ``2 * (W - 1) / W * 4 * params`` sent and received by every rank.

A rank's bytes for one collective are ``max(sent, received)`` (NVLink is full
duplex: the busier direction sets the time). Reported: max over ranks (``*_bytes``)
and mean (``*_bytes_mean``). Times, per rank and step:

* ``comm_ms = sum over collectives of max_r bytes_r / link_bw + n_collectives * latency``
  (collectives: one fused splits all-to-all + lengths + values per sharding type
  for input dist, one output dist and one backward per sharding type, one
  all-reduce per 25 MiB DDP bucket; none at W = 1);
* ``compute_ms`` = embedding HBM traffic / (HBM * gather efficiency)
  + dense FLOPs / (fp32 peak * efficiency) + streaming HBM traffic / (HBM * stream
  efficiency), with, per shard, ids n, bags b, c columns:
  embedding bytes = ``(3 * n * w + 2 * b * 4) * c`` (forward reads n rows of w-byte
  weights and writes b fp32 pooled rows; the fused backward reads b gradient rows,
  reads and writes n rows);
  dense FLOPs = ``6 * params * B`` (+ ``6 * (F + 1)^2 * D * B`` for the DLRM
  interaction bmm); streaming = the dense optimizer step (3 / 5 / 7 fp32 tensors of
  params touched for sgd / adagrad / adam) + ``3 * 4 * B`` per saved activation float.
  fused_uvm tables read rows over PCIe instead of HBM; cached tables are taken as
  all hits. Matmuls are fp32 (recpipe does not enable TF32);
* ``h2d_ms`` = one batch (:func:`recpipe.planner.memory.batch_bytes`) over PCIe.

``bound_ms = max(compute, comm, h2d)`` (a perfect pipeline), ``serial_ms`` = their
sum, ``sparse_dist_ms = max(h2d, input a2a, compute + output + backward + all-reduce)``
(sparse_dist hides H2D and the input all-to-all only). Ignored: host (CPU) launch
and Python overhead, which bound the DLRM-Criteo bench runs on 1-4 GPUs; kernel
launch gaps; load imbalance of hot ids.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from recpipe.planner.memory import LENGTH_BYTES, OUTPUT_BYTES, WEIGHT_BYTES, batch_bytes
from recpipe.planner.plan import grid, fmt_bytes
from recpipe.planner.inputs import DEFAULT_HBM_GB_WITHOUT_GPU, inputs_from_config
from recpipe.planner.spec import GiB, PlannerInputs
from recpipe.planner.tbe import INDEX_BYTES, shard_indices, shard_output_rows

if TYPE_CHECKING:
    from recpipe.config import ModelConfig, RecpipeConfig

MiB = 1 << 20
A2A_TYPES = ("table_wise", "row_wise", "table_row_wise", "column_wise")
ROW_TYPES = ("row_wise", "table_row_wise")  # one host: the same exchange
DDP_BUCKET_BYTES = 25 * MiB  # torch DDP bucket_cap_mb default
_OPT_TENSORS = {"sgd": 3, "adagrad": 5, "adam": 7}  # fp32 tensors read + written per param by the step


@dataclass(frozen=True)
class GpuSpec:
    """Datasheet numbers of one GPU (NVIDIA H100 / H200 SXM datasheets) and the
    efficiency factors applied to them (stated, not fitted to recpipe's runs)."""

    name: str
    hbm_bytes_per_s: float  # H100 SXM 3.35 TB/s HBM3; H200 SXM 4.8 TB/s HBM3e
    fp32_flops: float  # 67 TFLOP/s fp32 (non-tensor) on both
    nvlink_bytes_per_s: float  # NVLink 4: 900 GB/s bidirectional = 450 GB/s per direction
    pcie_bytes_per_s: float = 64e9  # PCIe Gen5 x16, per direction
    nvlink_efficiency: float = 0.8  # ~360 GB/s; all-to-all gets no NVLink SHARP (docs/scaling.md)
    collective_latency_s: float = 25e-6  # one NCCL collective, small message, one node
    fp32_efficiency: float = 0.7  # cuBLAS SGEMM on large MLP GEMMs
    hbm_gather_efficiency: float = 0.5  # TBE row gathers (512 B rows) and backward sort
    hbm_stream_efficiency: float = 0.8  # elementwise / optimizer streams
    pcie_efficiency: float = 0.8  # pinned cudaMemcpyAsync, ~51 GB/s

    def assumptions(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


GPUS = {
    "H100": GpuSpec("H100 SXM", hbm_bytes_per_s=3.35e12, fp32_flops=67e12, nvlink_bytes_per_s=450e9),
    "H200": GpuSpec("H200 SXM", hbm_bytes_per_s=4.8e12, fp32_flops=67e12, nvlink_bytes_per_s=450e9),
}


# ------------------------------------------------------------------ bytes per rank
def a2a_bytes(inputs: PlannerInputs) -> dict[str, list[tuple[float, float]]]:
    """(sent, received) bytes per rank of the input, output and backward
    all-to-alls and of the DDP all-reduce (formulas in the module docstring)."""
    W, B = inputs.world_size, inputs.batch_size
    kjt = [[0.0, 0.0] for _ in range(W)]
    out = [[0.0, 0.0] for _ in range(W)]  # values (not bytes): fwd and bwd send them at their own precision

    def send(acc: list[list[float]], src: int, dst: int, nbytes: float) -> None:
        if src != dst:  # what stays on its rank never crosses the link
            acc[src][0] += nbytes
            acc[dst][1] += nbytes

    for sh in inputs.shards:
        t = inputs.table(sh.table)
        if t.sharding_type == "data_parallel":
            continue
        share = sh.rows / t.rows if t.sharding_type in ROW_TYPES else 1.0
        id_bytes = INDEX_BYTES + (WEIGHT_BYTES if t.weighted else 0)
        # pooled: one row per sample and feature; sequence: one per id (RW: the
        # shard's ids only, sent back by an all-to-all, not reduce-scattered)
        rows = B * t.num_features if t.pooled else B * t.ids_per_sample * share
        for r in range(W):
            send(kjt, r, sh.rank, B * t.num_features * (LENGTH_BYTES + id_bytes * t.pooling_factor * share))
            if t.sharding_type not in ROW_TYPES or not t.pooled:
                send(out, sh.rank, r, rows * sh.cols)
    rw_dims = sum(t.dim * t.num_features for t in inputs.tables if t.sharding_type in ROW_TYPES and t.pooled)
    ring_rs = (W - 1) * B * rw_dims  # RW reduce-scatter, ring (values)
    ring_ar = 2 * (W - 1) / W * 4 * _replicated_params(inputs)
    fwd, bwd = inputs.comm_bytes  # sharding.comm_precision: fp32 4 B, fp16 / bf16 2 B per value
    return {
        "input_a2a": [tuple(x) for x in kjt],
        "output_a2a": [((snt + ring_rs) * fwd, (rcv + ring_rs) * fwd) for snt, rcv in out],
        "backward_a2a": [((rcv + ring_rs) * bwd, (snt + ring_rs) * bwd) for snt, rcv in out],
        "allreduce": [(ring_ar, ring_ar)] * W,
    }


def _replicated_params(inputs: PlannerInputs) -> int:
    """Parameters DDP all-reduces: the dense model and data-parallel tables."""
    dp = sum(t.rows * t.dim for t in inputs.tables if t.sharding_type == "data_parallel")
    return inputs.dense.num_params + dp


def collective_calls(inputs: PlannerInputs) -> dict[str, int]:
    """Collectives per step of each kind (the step's calls, as torchrec and recpipe make them)."""
    if inputs.world_size == 1:  # torchrec's all-to-alls return their input; DDP has no peer
        return {"input_a2a": 0, "output_a2a": 0, "backward_a2a": 0, "allreduce": 0}
    groups = len({t.sharding_type for t in inputs.tables} & set(A2A_TYPES))
    return {
        "input_a2a": (1 + 2 * groups) if groups else 0,  # fused splits, then lengths + values per group
        "output_a2a": groups,
        "backward_a2a": groups,
        "allreduce": max(1, math.ceil(4 * _replicated_params(inputs) / DDP_BUCKET_BYTES)),
    }


# ------------------------------------------------------------------ compute per rank
def compute_ms(inputs: PlannerInputs, rank: int, gpu: GpuSpec, interaction_flops: float = 0.0) -> dict[str, float]:
    """Embedding, dense and streaming time of one step on ``rank`` (ms);
    ``interaction_flops``: forward FLOPs per sample of parameter-free layers."""
    B = inputs.batch_size
    hbm_gather, pcie = 0.0, 0.0
    for s in inputs.shards_on(rank):
        n, b = shard_indices(inputs, s), shard_output_rows(inputs, s)
        wb = inputs.table(s.table).weight_bytes  # rows in the table's precision, outputs and gradients fp32
        nbytes = (3 * n * wb + 2 * b * OUTPUT_BYTES) * s.cols
        if inputs.table(s.table).kernel == "fused_uvm":
            pcie += nbytes
        else:
            hbm_gather += nbytes
    d = inputs.dense
    flops = (6 * d.num_params + 3 * interaction_flops) * B
    stream = 4 * _OPT_TENSORS[inputs.dense_optimizer] * _replicated_params(inputs)
    stream += 3 * B * (d.dense_arch_bytes + d.top_bytes)
    return {
        "emb_ms": 1e3 * (hbm_gather / (gpu.hbm_bytes_per_s * gpu.hbm_gather_efficiency)
                         + pcie / (gpu.pcie_bytes_per_s * gpu.pcie_efficiency)),
        "dense_ms": 1e3 * flops / (gpu.fp32_flops * gpu.fp32_efficiency),
        "stream_ms": 1e3 * stream / (gpu.hbm_bytes_per_s * gpu.hbm_stream_efficiency),
    }


# ------------------------------------------------------------------ one world size
def interaction_flops_per_sample(m: "ModelConfig") -> float:
    """Forward FLOPs per sample of the DLRM dot interaction (bmm of the [F+1, D]
    features with themselves): ``2 * (F + 1)^2 * D``. DCN's cross layers have
    parameters, so ``6 * params`` already counts them: 0."""
    if m.factory is not None:  # unknown; a user model's parameter-free layers are not modeled
        return 0.0
    return 2.0 * (m.num_sparse_features + 1) ** 2 * m.embedding_dim if m.arch == "dlrm" else 0.0


def predict_point(inputs: PlannerInputs, gpu: str = "H200", *, interaction_flops: float = 0.0) -> dict[str, Any]:
    """The model at ``inputs.world_size`` (pure: PlannerInputs in, a dict out).
    ``interaction_flops``: see :func:`interaction_flops_per_sample`."""
    if gpu not in GPUS:
        raise ValueError(f"gpu {gpu!r}: choose one of {', '.join(GPUS)}")
    g = GPUS[gpu]
    W, B = inputs.world_size, inputs.batch_size
    link = g.nvlink_bytes_per_s * g.nvlink_efficiency
    per_rank = a2a_bytes(inputs)
    n_coll = collective_calls(inputs)
    row: dict[str, Any] = {"world_size": W, "batch_size_per_rank": B, "global_batch": W * B}
    comm_s: dict[str, float] = {}
    for kind, pairs in per_rank.items():
        busy = [max(snt, rcv) for snt, rcv in pairs]
        row[f"{kind}_bytes"] = int(max(busy))
        row[f"{kind}_bytes_mean"] = int(sum(busy) / W)
        comm_s[kind] = max(busy) / link + n_coll[kind] * g.collective_latency_s
    row["n_collectives"] = sum(n_coll.values())
    parts = [compute_ms(inputs, r, g, interaction_flops) for r in range(W)]
    worst = max(parts, key=lambda p: sum(p.values()))
    comp = sum(worst.values())
    comm = 1e3 * sum(comm_s.values())
    h2d = 1e3 * batch_bytes(inputs) / (g.pcie_bytes_per_s * g.pcie_efficiency)
    times = {"compute": comp, "comm": comm, "h2d": h2d}
    bound_resource = max(times, key=lambda k: times[k])
    exposed = 1e3 * (comm_s["output_a2a"] + comm_s["backward_a2a"] + comm_s["allreduce"])
    row.update(
        comm_ms=comm, **{k: v for k, v in worst.items()}, compute_ms=comp, h2d_ms=h2d,
        bound_ms=times[bound_resource], bound_resource=bound_resource, serial_ms=comp + comm + h2d,
        sparse_dist_ms=max(h2d, 1e3 * comm_s["input_a2a"], comp + exposed),
    )
    row["samples_per_s_per_gpu"] = 1e3 * B / row["bound_ms"]
    row["kind"] = "prediction (model, not a measurement)"
    row["assumptions"] = dict(g.assumptions(), ddp_bucket_bytes=DDP_BUCKET_BYTES,
                              matmul="fp32", placement="recpipe config rules (inputs_from_config)")
    return row


def predict_scaling(
    cfg: "RecpipeConfig", world_sizes: tuple[int, ...] = (1, 2, 4, 8), *, gpu: str = "H200"
) -> list[dict[str, Any]]:
    """Weak-scaling prediction of ``cfg`` at each world size: per-rank all-to-all and
    all-reduce bytes, comm / compute / H2D time, the bound and what binds it.

    A model, not a measurement (formulas and constants: module docstring, and each
    row's ``assumptions``). Pure: no process group, no GPU; tables are placed as
    ``inputs_from_config(cfg, world_size=W)`` places them. Raises ``ValueError``
    naming W when the config cannot be placed on W ranks; warns that
    ``sharding.placement: planner`` is not followed (config rules place the tables)."""
    if cfg.sharding.placement == "planner":
        warnings.warn("predict_scaling: sharding.placement='planner' is ignored; tables are placed by the config "
                      "rules (table_wise on the least-loaded rank)", stacklevel=2)
    if not world_sizes or any(not isinstance(w, int) or w < 1 for w in world_sizes):
        raise ValueError(f"world sizes must be integers >= 1, got {list(world_sizes)}")
    if max(world_sizes) > 8:
        warnings.warn(f"predict_scaling: world size {max(world_sizes)} spans hosts; the model only knows NVLink "
                      "within one 8-GPU host, so its comm times are too low there", stacklevel=2)
    rows = []
    for W in world_sizes:
        pinned = {n: t.rank for n, t in cfg.table_sharding().items() if t.type == "table_wise" and t.rank is not None}
        too_high = {n: r for n, r in pinned.items() if r >= W}
        if too_high:
            raise ValueError(f"world size {W}: table_wise tables pinned to ranks >= {W}: "
                             + ", ".join(f"sharding.tables.{n}.rank={r}" for n, r in sorted(too_high.items())))
        try:  # capacity and FBGEMM version do not enter the model: fixed, no GPU query
            inputs = inputs_from_config(cfg, world_size=W, hbm_capacity_bytes=int(DEFAULT_HBM_GB_WITHOUT_GPU * GiB),
                                        fbgemm=(1, 8))
        except ValueError as err:
            raise ValueError(f"world size {W}: {err}") from err
        rows.append(predict_point(inputs, gpu, interaction_flops=interaction_flops_per_sample(cfg.model)))
    return rows


# ------------------------------------------------------------------ rendering
def growth(rows: list[dict[str, Any]]) -> list[tuple[int, int, float]]:
    """(W_a, W_b, ratio) of the max rank's all-to-all bytes (input + output +
    backward) between consecutive world sizes > 1: the number to check."""
    tot = [(r["world_size"], sum(r[f"{k}_bytes"] for k in ("input_a2a", "output_a2a", "backward_a2a"))) for r in rows]
    tot = [(w, b) for w, b in tot if w > 1 and b > 0]
    return [(wa, wb, bb / ba) for (wa, ba), (wb, bb) in zip(tot, tot[1:])]


def render_scaling(rows: list[dict[str, Any]]) -> str:
    """The prediction as a table (bytes: max over ranks, per step)."""
    if not rows:
        return ""
    a = rows[0]["assumptions"]
    out = [f"weak-scaling prediction ({a['name']}, {rows[0]['batch_size_per_rank']} samples per GPU): "
           "a model, not a measurement; host launch overhead is not modeled; bytes per step of the busiest rank"]
    header = ("W", "in a2a", "out a2a", "bwd a2a", "allreduce", "comm ms", "compute ms", "h2d ms",
              "bound ms", "binds", "serial ms", "sparse_dist ms", "samples/s/GPU")
    body = [(
        str(r["world_size"]), fmt_bytes(r["input_a2a_bytes"]), fmt_bytes(r["output_a2a_bytes"]),
        fmt_bytes(r["backward_a2a_bytes"]), fmt_bytes(r["allreduce_bytes"]), f"{r['comm_ms']:.3f}",
        f"{r['compute_ms']:.3f}", f"{r['h2d_ms']:.3f}", f"{r['bound_ms']:.3f}", r["bound_resource"],
        f"{r['serial_ms']:.3f}", f"{r['sparse_dist_ms']:.3f}", f"{r['samples_per_s_per_gpu']:,.0f}",
    ) for r in rows]
    out += ["  " + s for s in grid(header, body, right=set(range(1, 13)) - {9})]
    g = growth(rows)
    if g:
        steps = ", ".join(f"x{x:.2f} from W={wa} to W={wb}" for wa, wb, x in g)
        out.append(f"  all-to-all bytes of the busiest rank grow {steps}")
    out.append(f"  assumptions: link {a['nvlink_bytes_per_s'] * a['nvlink_efficiency'] / 1e9:.0f} GB/s per direction, "
               f"{a['collective_latency_s'] * 1e6:.0f} us per collective, HBM {a['hbm_bytes_per_s'] / 1e12:.2f} TB/s "
               f"(x{a['hbm_gather_efficiency']} gathers, x{a['hbm_stream_efficiency']} streams), fp32 "
               f"{a['fp32_flops'] / 1e12:.0f} TFLOP/s x{a['fp32_efficiency']}, PCIe "
               f"{a['pcie_bytes_per_s'] * a['pcie_efficiency'] / 1e9:.0f} GB/s")
    return "\n".join(out)
