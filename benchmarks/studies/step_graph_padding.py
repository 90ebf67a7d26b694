"""The host's padding of a batch for ``pipeline.step_graph`` (``pad_features``), timed on CPU:
the per-key, per-bucket loop against the padding of all keys and buckets at once.

    python benchmarks/studies/step_graph_padding.py --config configs/bench/dlrm_criteo.yaml --calls 50

Batches of the config's layout (its features, tables and ``data.batch_size``; one id per
feature per sample, uniform over each table), padded as a step graph pads them: row-wise
tables over ``--ranks`` ranks (one bucket per rank, each padded to its largest count over
the batches times ``headroom``) and, on one GPU, no buckets (each feature padded to its
ids times ``headroom``, as when ids per feature vary). Also timed:
the rest of the host's per-batch work around it (the padded batch's ``signature``, its
``pin_memory`` copy). One thread (``torch.set_num_threads(1)``); the median CPU time
(``time.thread_time``) over ``--calls`` calls, each on another batch. Prints a markdown table; ``--out PATH`` writes it.
"""

from __future__ import annotations

import math
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: the repository's packages first
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor  # noqa: E402

from benchmarks.studies.common import config_parser  # noqa: E402
from recpipe.config import load_config  # noqa: E402
from recpipe.speedups.defs.step_graph import StepGraphOptions  # noqa: E402
from recpipe.speedups.fixed_splits import Buckets  # noqa: E402
from recpipe.speedups.step_graph import pad_features, signature  # noqa: E402


def reference_pad_features(kjt, capacity, buckets=None):
    """The padding key by key, bucket by bucket: the per-key loop kept to measure against,
    and the definition ``pad_features`` must equal (tests/test_step_graph_padding.py)."""
    counts = kjt.length_per_key()
    buckets = buckets or [None] * len(counts)
    stride, w = kjt.stride(), kjt.weights_or_none()
    values, weights, pads = [], [], []
    for key_values, key_weights, cap, b in zip(kjt.values().split(counts),
                                              w.split(counts) if w is not None else [None] * len(counts),
                                              capacity, buckets):
        extra = _reference_padding(key_values, cap, b)
        if extra is None:
            return None
        values += [key_values, extra]
        pads.append(extra.numel())
        if key_weights is not None:
            weights += [key_weights, torch.zeros(extra.numel(), dtype=key_weights.dtype)]
    lengths = kjt.lengths().view(len(counts), stride)
    new_lengths = torch.cat([lengths, torch.tensor(pads, dtype=lengths.dtype).view(-1, 1)], dim=1).view(-1)
    return KeyedJaggedTensor(keys=kjt.keys(), values=torch.cat(values), lengths=new_lengths,
                             weights=torch.cat(weights) if w is not None else None, stride=stride + 1,
                             length_per_key=[n + p for n, p in zip(counts, pads)])


def _reference_padding(ids, cap, b):
    if b is None:
        cap = cap if isinstance(cap, int) else sum(cap)
        if ids.numel() >= cap:
            return ids[:0] if ids.numel() == cap else None
        source = ids if ids.numel() else torch.zeros(1, dtype=ids.dtype)
        return source[torch.arange(cap - ids.numel()) % source.numel()]
    bucket = b.of(ids)
    counts = torch.bincount(bucket, minlength=b.count).tolist()
    if any(n > c for n, c in zip(counts, cap)):
        return None
    out = []
    for r, (n, c) in enumerate(zip(counts, cap)):
        if c > n:
            source = ids[bucket == r] if n else torch.tensor([b.first_row(r)], dtype=ids.dtype)
            out.append(source[torch.arange(c - n) % source.numel()])
    return torch.cat(out) if out else ids[:0]


def batches(names: list[str], rows: list[int], stride: int, n: int, seed: int = 0) -> list[KeyedJaggedTensor]:
    """``n`` batches of one id per feature per sample, uniform over each table."""
    g = torch.Generator().manual_seed(seed)
    return [KeyedJaggedTensor(keys=names, values=torch.cat([torch.randint(0, r, (stride,), generator=g) for r in rows]),
                              lengths=torch.ones(len(names) * stride, dtype=torch.int32)) for _ in range(n)]


def capacities(measured: list[KeyedJaggedTensor], buckets: list[Buckets | None], headroom: float) -> list[list[int]]:
    """As the step graph measures them: per key (per bucket), the largest count times headroom."""
    counts = [[n for ids, b in zip(kjt.values().split(kjt.length_per_key()), buckets)
               for n in (b.counts(ids) if b is not None else [ids.numel()])] for kjt in measured]
    most = iter(torch.tensor(counts).max(dim=0).values.tolist())
    return [[math.ceil(next(most) * headroom) for _ in range(b.count if b is not None else 1)] for b in buckets]


def median_ms(fns: list, inputs: list) -> list[float]:
    """Each of ``fns`` called on every input, in turn: the median CPU milliseconds of each
    (the thread's CPU time: time spent waiting for a core on a loaded machine not counted)."""
    times = [[] for _ in fns]
    for fn in fns:
        fn(inputs[0])
    for x in inputs:
        for fn, out in zip(fns, times):
            start = time.thread_time()
            fn(x)
            out.append((time.thread_time() - start) * 1e3)
    return [statistics.median(t) for t in times]


def main(argv: list[str] | None = None) -> list[dict]:
    parser = config_parser(__doc__, config_default="configs/bench/dlrm_criteo.yaml")
    parser.add_argument("--ranks", type=int, default=4, help="ranks a row-wise table is split over (its buckets)")
    parser.add_argument("--calls", type=int, default=50, help="timed calls per row, each on another batch")
    parser.add_argument("--out", type=Path, help="write the markdown table here")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    cfg = load_config(args.config, args.overrides)
    names, rows = list(cfg.model.feature_names), list(cfg.model.num_embeddings_per_feature)
    stride, options = cfg.data.batch_size, StepGraphOptions()
    timed = batches(names, rows, stride, args.calls, seed=2)
    results = []
    for layout, buckets in ((f"row_wise over {args.ranks} ranks", [Buckets.of_table(r, args.ranks) for r in rows]),
                            ("1 GPU, no buckets", [None] * len(rows))):
        cap = capacities(timed, buckets, options.headroom)  # every batch fits: each is padded, as replays are
        for kjt in timed:
            want, got = reference_pad_features(kjt, cap, buckets), pad_features(kjt, cap, buckets)
            if not (torch.equal(got.values(), want.values()) and torch.equal(got.lengths(), want.lengths())):
                raise SystemExit(f"{layout}: pad_features differs from the per-key loop")
        padded = [pad_features(kjt, cap, buckets) for kjt in timed]
        loop_ms, vectorized_ms = median_ms([lambda k: reference_pad_features(k, cap, buckets),
                                            lambda k: pad_features(k, cap, buckets)], timed)
        results.append({
            "layout": layout, "keys": len(names), "stride": stride, "buckets": buckets[0].count if buckets[0] else 1,
            "loop_ms": loop_ms, "vectorized_ms": vectorized_ms, "signature_ms": median_ms([signature], padded)[0],
            "pin_memory_ms": median_ms([lambda k: k.pin_memory()], padded)[0] if torch.cuda.is_available() else None,
        })
    lines = ["| layout | keys x stride x buckets | per-key loop ms | all at once ms | speed-up | signature ms | "
             "pin_memory ms |", "|---|---|---:|---:|---:|---:|---:|"]
    for r in results:
        pin = "n/a (no CUDA)" if r["pin_memory_ms"] is None else f"{r['pin_memory_ms']:.2f}"
        lines.append(f"| {r['layout']} | {r['keys']} x {r['stride']} x {r['buckets']} | {r['loop_ms']:.2f} | "
                     f"{r['vectorized_ms']:.2f} | {r['loop_ms'] / r['vectorized_ms']:.1f}x | "
                     f"{r['signature_ms']:.3f} | {pin} |")
    table = "\n".join(lines)
    print(table)
    if args.out is not None:
        command = " ".join(["python benchmarks/studies/step_graph_padding.py", *(argv if argv is not None
                                                                                  else sys.argv[1:])])
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(
            "# pipeline.step_graph: the host's padding of a batch\n\n"
            f"    {command}\n\n"
            f"torch {torch.__version__}, one thread; each cell the median CPU time of a call over {args.calls} "
            "batches (one id per feature per sample, uniform over each table), the two paddings called in turn "
            "on each batch; `pin_memory` needs CUDA.\n\n" + table + "\n")
    return results


if __name__ == "__main__":
    main()
