"""Schedules are data: which step runs on which stream, for which batch, after what.

One ``progress()`` call of a pipeline runs its schedule's steps in list order. Each
``Step`` acts on the batch ``offset`` places ahead of the one being trained (0 = the
batch trained in this call, 1 = the next one, ...), on the stream of its ``stream``
role, after the GPU events of the steps named in ``waits`` (``(step, delta)``: the
step of the same batch when delta is 0, of the batch one ahead in the pipeline when
delta is -1). A batch enters at the largest offset through ``h2d`` (the only step
that fetches) and moves one offset down per call, so it meets every step exactly
once. ``recpipe schedule NAME`` prints these tables.

Validation at import time checks what modded-nanogpt checks of its order lists:
every step appears once, ``h2d`` is the entry step, and every wait names a step
that runs earlier for that batch.
"""

from __future__ import annotations

from dataclasses import dataclass

STREAM_ROLES = ("compute", "memcpy", "dist", "lookup", "prefetch")

# What each step does (the functions are in recpipe.runtime.steps).
STEP_DOC = {
    "h2d": "fetch the next host batch (all ranks agree on end of data) and copy it to the device",
    "input_dist": "start the input all-to-all: launch the splits all-to-all of each sharded module",
    "input_dist_wait": "host sync: .tolist() on the splits, then launch the values/lengths all-to-all",
    "lookup": "embedding lookup + launch of the output all-to-all (compute_and_output_dist)",
    "output_dist_wait": "wait for the lookup's output all-to-all here, freeing the lookup's own output",
    "prefetch": "UVM cache prefetch (FBGEMM locks the cache lines until this batch's backward)",
    "zero_grad": "zero the dense gradients",
    "forward": "model(batch): sharded modules take their prepared inputs/outputs",
    "forward_eval": "model(batch) in eval mode under torch.no_grad(): its output for the metrics, no loss kept",
    "backward": "loss.backward(): dense grads + fused TBE update of the embedding rows",
    "backward_dense": "loss.backward() down to the (detached) pooled embeddings",
    "backward_emb": "pooled-embedding backward: output all-to-all backward + fused TBE update",
    "backward_outdist": "pooled-embedding backward down to the lookups' outputs: output all-to-all backward only",
    "backward_tbe": "TBE backward of the lookups' outputs: the fused embedding update",
    "optimizer": "dense optimizer step (the embedding optimizer ran inside the TBE backward)",
    "train_step": "the whole training step (forward, backward, both optimizers) as one CUDA graph replay",
}

# The stream a step's role names, as the planner calls it ("main": the caller's stream).
_STREAM_NAMES = {"compute": "main", "memcpy": "memcpy", "dist": "dist", "lookup": "lookup", "prefetch": "prefetch"}
# The step that runs batch i's TBE backward, where a step's memory peaks.
_TBE_BACKWARD = ("backward", "backward_emb", "backward_tbe", "train_step")


@dataclass(frozen=True)
class Step:
    name: str
    stream: str
    offset: int
    waits: tuple[tuple[str, int], ...] = ()

    def describe(self) -> str:
        return STEP_DOC[self.name]


@dataclass(frozen=True)
class Schedule:
    name: str
    steps: tuple[Step, ...]
    doc: str

    @property
    def depth(self) -> int:
        """Batches in flight: the trained one plus those the side streams work ahead on."""
        return max(s.offset for s in self.steps) + 1

    @property
    def roles(self) -> frozenset[str]:
        return frozenset(s.stream for s in self.steps)

    def steps_at(self, offset: int) -> list[Step]:
        return [s for s in self.steps if s.offset == offset]

    def catch_up(self, slot: int) -> list[Step]:
        """Steps a batch entering at ``slot`` (during fill) must already have done:
        every step with a larger offset, largest offset first, in list order."""
        return [s for off in range(self.depth - 1, slot, -1) for s in self.steps_at(off)]

    def validate(self) -> "Schedule":
        names = [s.name for s in self.steps]
        dupes = {n for n in names if names.count(n) > 1}
        if dupes:
            raise ValueError(f"schedule {self.name}: steps {sorted(dupes)} appear more than once")
        unknown = [n for n in names if n not in STEP_DOC]
        if unknown:
            raise ValueError(f"schedule {self.name}: unknown steps {unknown}")
        bad_streams = [s.name for s in self.steps if s.stream not in STREAM_ROLES]
        if bad_streams:
            raise ValueError(f"schedule {self.name}: steps {bad_streams} name no stream role of {STREAM_ROLES}")
        entry = [s for s in self.steps if s.offset == self.depth - 1]
        if "h2d" not in names or [s.name for s in entry][:1] != ["h2d"]:
            raise ValueError(f"schedule {self.name}: 'h2d' must be the first step at the largest offset")
        for s in self.steps:
            if s.offset < 0:
                raise ValueError(f"schedule {self.name}: step {s.name} has negative offset {s.offset}")
            for dep, delta in s.waits:
                if dep not in names:
                    raise ValueError(f"schedule {self.name}: {s.name} waits on missing step {dep}")
                if delta not in (0, -1):
                    raise ValueError(f"schedule {self.name}: {s.name} waits with delta {delta}; use 0 or -1")
                if delta == 0 and not self._runs_before(dep, s):
                    raise ValueError(f"schedule {self.name}: {s.name} waits on {dep}, which runs later for that batch")
        return self

    def _runs_before(self, first: str, then: Step) -> bool:
        """Does step ``first`` run earlier than ``then`` in a batch's life?"""
        a = next(s for s in self.steps if s.name == first)
        if a.offset != then.offset:
            return a.offset > then.offset
        return self.steps.index(a) < self.steps.index(then)

    def same_stages(self, other: "Schedule") -> bool:
        """Two schedules a pipeline switches between must move batches identically."""
        return sorted((s.name, s.offset) for s in self.steps) == sorted((s.name, s.offset) for s in other.steps)

    def table(self) -> str:
        header = ("#", "step", "stream", "batch", "waits on", "what")
        rows = [
            (
                str(i),
                s.name,
                s.stream,
                "i" if s.offset == 0 else f"i+{s.offset}",
                ", ".join(f"{d}({'same' if k == 0 else 'prev'})" for d, k in s.waits) or "-",
                s.describe(),
            )
            for i, s in enumerate(self.steps)
        ]
        widths = [max(len(h), *(len(r[c]) for r in rows)) for c, h in enumerate(header)]
        fmt = "  ".join(f"{{:<{w}}}" for w in widths)
        lines = [f"schedule {self.name}: {self.depth} batches in flight", self.doc, ""]
        lines += [fmt.format(*header), fmt.format(*("-" * w for w in widths))]
        lines += [fmt.format(*r).rstrip() for r in rows]
        return "\n".join(lines)


def memory_facts(schedule: Schedule) -> dict[str, object]:
    """What the planner needs to know about a schedule (the fields of
    ``recpipe.planner.spec.PipelineSpec``), read off its table at the point where a step's
    memory peaks: the TBE backward of batch i (offset 0).

    * ``batches_in_flight``: its depth; ``side_streams``: its stream roles besides compute;
    * ``dist_kjts_in_flight``: batches whose received KJTs are alive there: batch i, and
      each batch ahead whose ``input_dist_wait`` ran in an earlier call or earlier in this one;
    * ``pending_input_dists``: batches ahead whose input dist was launched by then but whose
      consumer (lookup, prefetch or forward) has not run yet;
    * ``lookup_stream``, ``prefetch``; and for early lookups of batch i+1: before the
      backward (``early_pooled``), inside it, after the output all-to-all backward and before
      the TBE update (``early_pooled_at_update``), or after it (``lookup_after_backward``); ``dense_backward_first`` (batch i was looked up
      before its forward), ``keeps_emb_graph`` (the embedding backward is a step of its own)."""
    steps = list(schedule.steps)
    names = [s.name for s in steps]
    backward = next(i for i, s in enumerate(steps) if s.offset == 0 and s.name in _TBE_BACKWARD)

    def position(name: str) -> tuple[int, int] | None:
        return next(((s.offset, i) for i, s in enumerate(steps) if s.name == name), None)

    def done_by_backward(name: str, k: int) -> bool:
        """Has step ``name`` run for the batch at offset ``k`` before backward(0)?"""
        where = position(name)
        return where is not None and (where[0] > k or (where[0] == k and where[1] < backward))

    ahead = range(1, schedule.depth)
    consumers = [n for n in names if n in ("lookup", "prefetch", "forward")]
    first_consumer = min(consumers, key=lambda n: (-position(n)[0], position(n)[1]))
    lookup = position("lookup")
    lookup_step = next((s for s in steps if s.name == "lookup"), None)
    early = lookup is not None and lookup[0] >= 1
    at_update = early and "backward_outdist" in names and names.index("backward_outdist") < lookup[1]
    return {
        "batches_in_flight": schedule.depth,
        "dist_kjts_in_flight": 1 + sum(done_by_backward("input_dist_wait", k) for k in ahead),
        "pending_input_dists": sum(done_by_backward("input_dist", k) and not done_by_backward(first_consumer, k)
                                   for k in ahead),
        "side_streams": tuple(r for r in STREAM_ROLES if r != "compute" and r in schedule.roles),
        "lookup_stream": _STREAM_NAMES[lookup_step.stream] if lookup_step is not None else "main",
        "prefetch": "prefetch" in names,
        "early_pooled": early and lookup[1] < backward and not at_update,
        "early_pooled_at_update": at_update,
        "lookup_after_backward": early and lookup[1] > backward and not at_update,
        "dense_backward_first": early,
        "keeps_emb_graph": "backward_emb" in names,
    }
