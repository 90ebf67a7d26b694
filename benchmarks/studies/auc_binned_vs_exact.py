"""Binned AUC (recpipe's ``BinnedAUROC``) against TorchRec's exact AUC (``torchrec.metrics.auc.AUCMetric``)
on one log interval of click predictions: the value, the state each keeps, the time of an update and a
compute, and whether the multi-rank sync needs a host round trip.

    python benchmarks/studies/auc_binned_vs_exact.py --samples 819200 --device cpu --out runs/auc_study
    python benchmarks/studies/auc_binned_vs_exact.py --samples 819200,8192000 --device cuda --out runs/auc_study_gpu

``--samples``: predictions per interval (100 steps x 8192 samples = 819,200, the trainer's default
``train.log_every`` at a Criteo-sized batch). Predictions come from a planted model (logit = signal +
noise, labels drawn from the sigmoid) so the AUC is in a realistic range. TorchRec's AUC keeps every
prediction, label and weight of its window (``window_size`` samples) and syncs them with torchmetrics'
``gather_all_tensors`` (an all-gather of each rank's state sizes to the host before the data: a host
sync); the binned AUC keeps 2 x (thresholds + 1) float64 and is all-reduced like a sum, with no host
round trip. Writes OUT/auc_binned_vs_exact.json and .md.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: the repository's packages first
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
from torchrec.metrics.auc import AUCMetric  # noqa: E402
from torchrec.metrics.metrics_config import RecTaskInfo  # noqa: E402

from recpipe.train.metrics import BinnedAUROC  # noqa: E402


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn, device: torch.device, repeats: int = 5) -> float:
    """Median milliseconds of ``fn()`` over ``repeats`` runs after one warm-up."""
    fn()
    times = []
    for _ in range(repeats):
        _synchronize(device)
        start = time.perf_counter()
        fn()
        _synchronize(device)
        times.append((time.perf_counter() - start) * 1e3)
    return sorted(times)[len(times) // 2]


def measure(samples: int, device: torch.device, thresholds: int) -> dict:
    g = torch.Generator().manual_seed(0)
    signal = torch.randn(samples, generator=g)
    labels = (torch.rand(samples, generator=g) < torch.sigmoid(2 * signal - 1)).float()
    preds = torch.sigmoid(signal + 0.8 * torch.randn(samples, generator=g))
    preds, labels, weights = preds.to(device), labels.to(device), torch.ones(samples, device=device)
    task = RecTaskInfo(name="click", label_name="label", prediction_name="prediction", weight_name="weight")

    def exact():
        metric = AUCMetric(world_size=1, my_rank=0, batch_size=samples, tasks=[task], window_size=samples).to(device)
        metric.update(predictions={"click": preds}, labels={"click": labels}, weights={"click": weights})
        return metric, next(iter(metric.compute().values()))

    def binned():
        metric = BinnedAUROC(thresholds).to(device)
        metric.update(preds, labels, weights > 0)
        return metric, metric.compute()

    exact_metric, exact_auc = exact()
    binned_metric, binned_auc = binned()
    def state(m) -> int:  # the bytes of a torchmetrics Metric's states (tensors and lists of tensors)
        values = [getattr(m, name) for name in m._defaults]
        return sum(t.numel() * t.element_size() for v in values for t in (v if isinstance(v, list) else [v]))

    return {
        "samples": samples,
        "device": str(device),
        "exact_auc": float(exact_auc),
        "binned_auc": float(binned_auc),
        "abs_diff": abs(float(exact_auc) - float(binned_auc)),
        "exact_state_bytes": state(exact_metric._metrics_computations[0]),
        "binned_state_bytes": state(binned_metric),
        "exact_update_and_compute_ms": _timed(exact, device),
        "binned_update_and_compute_ms": _timed(binned, device),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", default="819200", help="comma-separated interval sizes (default: %(default)s)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--thresholds", type=int, default=1000, help="the binned AUC's (default: %(default)s)")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    rows = [measure(int(n), torch.device(args.device), args.thresholds) for n in args.samples.split(",")]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "auc_binned_vs_exact.json").write_text(json.dumps({"torch": torch.__version__, "rows": rows}, indent=2))
    lines = ["| samples | device | exact AUC | binned AUC | abs diff | exact state | binned state | exact ms | binned ms |",
             "|---|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['samples']:,} | {r['device']} | {r['exact_auc']:.6f} | {r['binned_auc']:.6f} | {r['abs_diff']:.1e} | "
              f"{r['exact_state_bytes'] / 2**20:.1f} MiB | {r['binned_state_bytes'] / 2**10:.1f} KiB | "
              f"{r['exact_update_and_compute_ms']:.1f} | {r['binned_update_and_compute_ms']:.1f} |" for r in rows]
    (out / "auc_binned_vs_exact.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
