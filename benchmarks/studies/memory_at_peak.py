"""What is alive at a pipeline's step-only memory peak, and who allocated it (CUDA).

    torchrun --standalone --nproc-per-node 2 benchmarks/studies/memory_at_peak.py --config configs/bench/dlrm_criteo.yaml \\
        --pipelines sparse_dist,semi_sync,semi_sync:output_dist_wait=early --out runs/mem_peak

(or without torchrun: ``distributed.nproc`` local processes, as ``recpipe bench`` runs).

For each pipeline (names or bench variants ``name:key=value``): a fresh model as in
``recpipe bench``, ``--warmup`` steps, then torch's allocator history
(``torch.cuda.memory._record_memory_history``, Python stacks) over ``--steps`` steps.
Replaying the history (alloc / free_completed) gives the live bytes at every event;
at the largest, the blocks allocated inside the recorded steps are grouped by the
innermost frame in recpipe, torchrec or fbgemm_gpu (file:line function) and by stream.
Reserved memory: peak reserved / peak allocated over the recorded steps, and the
allocator's segments at their end by stream (reserved, allocated, free, largest free
block), the free bytes grouped by their last occupant's site.
Rank 0 writes OUT/memory_at_peak.md (the tables, per rank) and every rank its
allocator snapshot OUT/snapshot_<pipeline>_rank<r>.pickle (open it at
https://pytorch.org/memory_viz).
"""

from __future__ import annotations

import bisect
import pickle
import sys
from collections import defaultdict
from pathlib import Path

if __package__ in (None, ""):  # run as a script: the repository's packages first
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from tqdm import tqdm  # noqa: E402

from benchmarks.studies.common import command, config_parser  # noqa: E402
from recpipe.bench.measure import free_device_memory  # noqa: E402
from recpipe.bench.run import Steps, build_run, config_for_pipeline, fresh_batches, gather, untimed_steps  # noqa: E402
from recpipe.bench.runner import launch, pregenerate  # noqa: E402
from recpipe.config import load_config  # noqa: E402
from recpipe.distributed import init_process_group, torchrun_overrides  # noqa: E402

_GIB = 2**30
_OWN = ("recpipe/", "torchrec/", "fbgemm_gpu/")


def _where(frames: list[dict]) -> str:
    """The innermost frame in recpipe / torchrec / fbgemm_gpu (else the innermost)."""
    for f in frames:
        if any(own in f["filename"] for own in _OWN):
            path = f["filename"]
            short = path[max(path.rfind(own) for own in _OWN if own in path):]
            return f"{short}:{f['line']} {f['name']}"
    return f"{frames[0]['filename']}:{frames[0]['line']} {frames[0]['name']}" if frames else "(no Python frame)"


def peak_live(trace: list[dict]) -> tuple[int, dict[int, dict]]:
    """(extra bytes at the peak, {addr: alloc event} alive then) over the recorded
    events; blocks allocated before recording are not in the trace (the baseline)."""
    live: dict[int, dict] = {}
    total = best = 0
    best_live: dict[int, dict] = {}
    for event in trace:
        if event["action"] == "alloc":
            live[event["addr"]] = event
            total += event["size"]
            if total > best:
                best, best_live = total, dict(live)
        elif event["action"] == "free_completed" and event["addr"] in live:
            total -= live.pop(event["addr"])["size"]
    return best, best_live


def summarize(trace: list[dict], streams: dict[int, str]) -> dict:
    best, alive = peak_live(trace)
    by_site: dict[str, int] = defaultdict(int)
    by_stream: dict[str, int] = defaultdict(int)
    for event in alive.values():
        by_site[_where(event.get("frames", []))] += event["size"]
        by_stream[streams.get(event["stream"], str(event["stream"]))] += event["size"]
    return {"peak_extra_gib": best / _GIB, "blocks": len(alive),
            "by_site": sorted(by_site.items(), key=lambda kv: -kv[1])[:12],
            "by_stream": sorted(by_stream.items(), key=lambda kv: -kv[1])}


def reserved_summary(segments: list[dict], trace: list[dict], streams: dict[int, str]) -> dict:
    """What the allocator holds beyond the allocated bytes, at the end of the recorded
    steps (reserved memory is never returned without ``empty_cache``, so the segments
    are those of the peak): per stream the reserved, allocated and free bytes, the
    largest free block, and the free bytes by the site of the block's last occupant
    (the newest recorded free in its range; "(before recording)" if none)."""
    frees = sorted(((e["addr"], e["size"], i, e) for i, e in enumerate(trace) if e["action"] == "free_completed"),
                   key=lambda f: (f[0], f[2]))
    addrs = [f[0] for f in frees]
    per_stream: dict[str, dict] = {}
    by_site: dict[str, int] = defaultdict(int)
    for seg in segments:
        name = streams.get(seg["stream"], str(seg["stream"]))
        row = per_stream.setdefault(name, {"reserved": 0, "allocated": 0, "free": 0, "largest_free": 0, "segments": 0})
        row["reserved"] += seg["total_size"]
        row["allocated"] += seg["allocated_size"]
        row["segments"] += 1
        for block in seg["blocks"]:
            if block["state"] != "inactive":
                continue
            row["free"] += block["size"]
            row["largest_free"] = max(row["largest_free"], block["size"])
            lo, hi = block["address"], block["address"] + block["size"]
            first, end = bisect.bisect_left(addrs, lo), bisect.bisect_left(addrs, hi)
            last = max(frees[first:end], key=lambda f: f[2], default=None)
            by_site[f"{name}: " + (_where(last[3].get("frames", [])) if last else "(before recording)")] += block["size"]
    return {"by_stream": per_stream, "free_by_site": sorted(by_site.items(), key=lambda kv: -kv[1])[:10]}


_MIB = 2**20


def gap_at_peak(snapshot: dict, device_index: int, streams: dict[int, str], min_hole: int = _MIB) -> dict:
    """Reserved but free memory at the moment of peak allocated inside the recorded
    steps: what makes peak reserved exceed peak allocated.

    Replays the trace backwards from the end state (the snapshot's segments and their
    allocated blocks): undoing an ``alloc`` frees its block, undoing a
    ``free_completed`` makes it allocated again (so blocks from before the recording
    are covered), undoing ``segment_map`` / ``segment_alloc`` removes the range from
    the reserved memory (and ``segment_unmap`` / ``segment_free`` adds it). At the
    largest allocated total, per stream: reserved, allocated, free, and the free
    holes of at least ``min_hole`` bytes with the site that last held the range
    before the peak and the one that takes it next."""
    trace = snapshot["device_traces"][device_index]
    live: dict[int, tuple[int, int]] = {}
    mapped: dict[int, tuple[int, int]] = {}  # start -> (size, stream)
    for seg in snapshot["segments"]:
        if seg.get("device", device_index) != device_index:
            continue
        mapped[seg["address"]] = (seg["total_size"], seg["stream"])
        for block in seg["blocks"]:
            if block["state"] in ("active_allocated", "active_pending_free"):
                live[block["address"]] = (block["size"], seg["stream"])
    total = sum(size for size, _ in live.values())
    best, best_index, best_live, best_mapped = total, len(trace), dict(live), dict(mapped)
    for i in range(len(trace) - 1, -1, -1):
        e = trace[i]
        action = e["action"]
        if action == "alloc":
            if live.pop(e["addr"], None) is not None:
                total -= e["size"]
        elif action == "free_completed":
            if e["addr"] not in live:
                live[e["addr"]] = (e["size"], e["stream"])
                total += e["size"]
        elif action in ("segment_map", "segment_alloc"):
            _unmap(mapped, e["addr"], e["size"])
        elif action in ("segment_unmap", "segment_free"):
            mapped[e["addr"]] = (e["size"], e["stream"])
        if total > best:  # the state before event i, i.e. right after event i - 1
            best, best_index, best_live, best_mapped = total, i, dict(live), dict(mapped)
    per_stream: dict[str, dict] = {}
    holes: list[tuple[int, int, str]] = []
    starts = sorted(best_live)
    for start, (size, stream) in sorted(best_mapped.items()):
        name = streams.get(stream, str(stream))
        row = per_stream.setdefault(name, {"reserved": 0, "allocated": 0, "free": 0, "holes": 0})
        row["reserved"] += size
        cursor, end = start, start + size
        for addr in starts[bisect.bisect_left(starts, start):bisect.bisect_left(starts, end)]:
            if addr > cursor:
                holes.append((cursor, addr - cursor, name))
            row["allocated"] += best_live[addr][0]
            cursor = max(cursor, addr + best_live[addr][0])
        if end > cursor:
            holes.append((cursor, end - cursor, name))
    for addr, size, name in holes:
        per_stream[name]["free"] += size
        per_stream[name]["holes"] += 1
    big = sorted((h for h in holes if h[1] >= min_hole), key=lambda h: -h[1])[:15]
    rows = []
    for addr, size, name in big:
        before = [e for e in trace[:best_index] if e["action"] == "free_completed" and _overlaps(e, addr, size)]
        after = [e for e in trace[best_index:] if e["action"] == "alloc" and _overlaps(e, addr, size)]
        rows.append({"stream": name, "size": size,
                     "last_before": _event_site(before[-1]) if before else "(before recording)",
                     "next_after": _event_site(after[0]) if after else "(not reused)"})
    return {"peak_allocated": best, "event": best_index, "events": len(trace), "by_stream": per_stream,
            "holes": rows}


def _unmap(mapped: dict[int, tuple[int, int]], addr: int, size: int) -> None:
    """Remove [addr, addr + size) from the mapped ranges (splitting a range that holds it)."""
    for start, (length, stream) in list(mapped.items()):
        end = start + length
        if end <= addr or start >= addr + size:
            continue
        del mapped[start]
        if start < addr:
            mapped[start] = (addr - start, stream)
        if end > addr + size:
            mapped[addr + size] = (end - addr - size, stream)


def _overlaps(event: dict, addr: int, size: int) -> bool:
    return event["addr"] < addr + size and addr < event["addr"] + event["size"]


def _event_site(event: dict) -> str:
    return f"{event['size'] / _MIB:.0f} MiB at {_where(event.get('frames', []))}"


def gap_markdown(gap: dict) -> list[str]:
    lines = [f"At the peak allocated inside the recorded steps ({gap['peak_allocated'] / _GIB:.3f} GiB, event "
             f"{gap['event']} of {gap['events']}):", "",
             "| stream | reserved GiB | allocated GiB | free GiB | free holes |", "|---|---|---|---|---|"]
    lines += [f"| {s} | {v['reserved'] / _GIB:.3f} | {v['allocated'] / _GIB:.3f} | {v['free'] / _GIB:.3f} | {v['holes']} |"
              for s, v in gap["by_stream"].items()]
    lines += ["", "| free hole MiB | stream | last held before the peak | next taken by |", "|---|---|---|---|"]
    lines += [f"| {h['size'] / _MIB:.1f} | {h['stream']} | `{h['last_before']}` | `{h['next_after']}` |"
              for h in gap["holes"]]
    return lines + [""]


def stream_roles(device: torch.device, pipe) -> dict[int, str]:
    """``{cuda_stream handle: role}``: the current stream is ``compute``; a recpipe pipeline's
    streams by their role (its ``streams``), a TorchRec one's by its ``*_stream`` attributes."""
    names = {torch.cuda.current_stream(device).cuda_stream: "compute"}
    roles = getattr(pipe, "streams", None)
    pairs = list(vars(roles).items()) if roles is not None and hasattr(roles, "__dataclass_fields__") else []
    pairs += [(k.strip("_").removesuffix("_stream"), v) for k, v in vars(pipe).items() if k.endswith("_stream")]
    for role, stream in pairs:
        if isinstance(getattr(stream, "cuda_stream", None), int):  # a torch.cuda.Stream
            names.setdefault(stream.cuda_stream, role)
    return names


def run_one(cfg, label: str, args, batches, device, out: Path) -> dict:
    cfg_p, _, skip = config_for_pipeline(cfg, label)
    if cfg_p is None:
        return {"skipped": skip}
    free_device_memory(device)
    sharded, pipe = build_run(cfg_p, "recpipe", device)
    it, bar = fresh_batches(batches, device), tqdm(disable=True)
    step = Steps(pipe, it, device)
    untimed_steps(step, bar, args.warmup)
    torch.cuda.synchronize()
    streams = stream_roles(device, pipe)
    torch.cuda.reset_peak_memory_stats(device)
    torch.cuda.memory._record_memory_history(max_entries=1_000_000, stacks="python")
    for _ in range(args.steps):
        step()
    torch.cuda.synchronize()
    snapshot = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    rank = dist.get_rank()
    name = label.replace(":", "_").replace("=", "-").replace("+", "_")
    with open(out / f"snapshot_{name}_rank{rank}.pickle", "wb") as f:
        pickle.dump(snapshot, f)
    trace = snapshot["device_traces"][device.index if device.index is not None else torch.cuda.current_device()]
    result = summarize(trace, streams)
    result["alloc_gib"] = torch.cuda.memory_allocated(device) / _GIB
    result["reserved_gib"] = torch.cuda.memory_reserved(device) / _GIB
    result["peak_allocated_gib"] = torch.cuda.max_memory_allocated(device) / _GIB
    result["peak_reserved_gib"] = torch.cuda.max_memory_reserved(device) / _GIB
    result["reserved"] = reserved_summary(snapshot["segments"], trace, streams)
    result["gap"] = gap_at_peak(snapshot, device.index if device.index is not None else torch.cuda.current_device(),
                                streams)
    untimed_steps(step, bar)  # the drain
    del pipe, sharded
    free_device_memory(device)
    return result


def markdown(results: dict[str, list[dict]], args) -> str:
    lines = ["# Live memory at the step-only peak, by allocation site", "",
             f"`{args.command}`; {torch.cuda.get_device_name()}, torch {torch.__version__}; "
             f"{args.warmup} warm-up steps, then {args.steps} recorded. Extra = bytes allocated inside the recorded "
             "steps and alive at their peak (the model and anything older is the baseline).", ""]
    for label, per_rank in results.items():
        lines += [f"## {label}", ""]
        for rank, r in enumerate(per_rank):
            if "skipped" in r:
                lines += [f"rank {rank}: skipped: {r['skipped']}", ""]
                continue
            lines += [f"rank {rank}: extra at peak {r['peak_extra_gib']:.3f} GiB in {r['blocks']} blocks; "
                      f"by stream: " + ", ".join(f"{s} {b / _GIB:.3f}" for s, b in r["by_stream"]), "",
                      "| GiB | allocated at |", "|---|---|"]
            lines += [f"| {b / _GIB:.3f} | `{site}` |" for site, b in r["by_site"]]
            lines.append("")
            res = r.get("reserved")
            if res:
                lines += [f"rank {rank}: peak reserved / peak allocated over the recorded steps: "
                          f"{r['peak_reserved_gib']:.3f} / {r['peak_allocated_gib']:.3f} GiB = "
                          f"{r['peak_reserved_gib'] / max(r['peak_allocated_gib'], 1e-12):.3f}", "",
                          "| stream | segments | reserved GiB | allocated GiB | free GiB | largest free GiB |",
                          "|---|---|---|---|---|---|"]
                lines += [f"| {s} | {v['segments']} | {v['reserved'] / _GIB:.3f} | {v['allocated'] / _GIB:.3f} | "
                          f"{v['free'] / _GIB:.3f} | {v['largest_free'] / _GIB:.3f} |" for s, v in res["by_stream"].items()]
                lines += ["", "| free GiB | last occupant (stream: site) |", "|---|---|"]
                lines += [f"| {b / _GIB:.3f} | `{site}` |" for site, b in res["free_by_site"]]
                lines.append("")
            if r.get("gap"):
                lines += gap_markdown(r["gap"])
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = config_parser(__doc__, config_required=False)
    parser.add_argument("--snapshot", action="append", default=[], metavar="PICKLE",
                        help="only analyse saved snapshots (e.g. tests/test_planner_gpu.py's): the free "
                             "holes at the peak allocated of each (streams by id)")
    parser.add_argument("--pipelines", default="sparse_dist,semi_sync")
    parser.add_argument("--warmup", type=int, default=8)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    args.command = command("memory_at_peak", argv)
    if args.snapshot:
        for path in args.snapshot:
            with open(path, "rb") as f:
                snap = pickle.load(f)
            device = next(i for i, t in enumerate(snap["device_traces"]) if t)
            print("\n".join([f"## {path}", ""] + gap_markdown(gap_at_peak(snap, device, {}))))
        return 0
    if not args.config or not args.out:
        parser.error("--config and --out are required (or --snapshot)")
    cfg = load_config(args.config, [*args.overrides, *torchrun_overrides()])
    if not torch.cuda.is_available():
        raise SystemExit("memory_at_peak needs CUDA (the allocator history is the CUDA caching allocator's)")
    launch(worker, cfg, args)
    return 0


def worker(cfg, args) -> None:
    """One rank: every pipeline's recorded steps; rank 0 writes the report."""
    device = init_process_group(cfg)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    batches = pregenerate(cfg, dist.get_rank(), dist.get_world_size(), args.warmup + args.steps + 8, device)
    results = {label: gather(run_one(cfg, label, args, batches, device, out))
               for label in args.pipelines.split(",") if label}
    if dist.get_rank() == 0:
        (out / "memory_at_peak.md").write_text(markdown(results, args))
        print(markdown(results, args))


if __name__ == "__main__":
    sys.exit(main())
