"""``recpipe plan --config PATH [--format table|json] [--set KEY=VALUE ...] [--scaling W1,W2,...]``.

Prints the memory plan (table or JSON) on stdout. Exit codes: 0 it fits, 3
(``EXIT_DOES_NOT_FIT``) some rank does not fit: stderr names the rank, its capacity
and its largest terms, and the cheapest changes that make it fit, each checked by
planning the changed config, with the memory it frees (:func:`recpipe.planner.advice.advise`;
in JSON under ``"advice"``). A bad config raises
``ConfigError``, which ``recpipe.cli`` turns into exit code 2.

``--scaling 1,2,4,8`` adds the weak-scaling prediction of
:func:`recpipe.planner.scaling.predict_scaling` (for H200 SXM GPUs; other GPUs from
Python): after the memory table in table form,
as a top-level ``"scaling"`` list (one entry per world size) in JSON. The memory
plan itself stays the one at ``distributed.nproc`` and decides the exit code. A
malformed list, or a world size the config cannot be placed on, is a
``ConfigError`` (exit 2).
"""

from __future__ import annotations

import argparse
import json
import sys

from recpipe.config import ConfigError, load_config
from recpipe.exit_codes import EXIT_DOES_NOT_FIT
from recpipe.planner import estimate_memory, planner_inputs
from recpipe.planner.advice import advice_lines, advise
from recpipe.planner.plan import check_fits, render_table
from recpipe.planner.scaling import predict_scaling, render_scaling
from recpipe.preflight import check_rules

SCALING_GPU = "H200"


def parse_world_sizes(text: str) -> tuple[int, ...]:
    """``"1,2,4,8"`` -> (1, 2, 4, 8); ConfigError naming the text otherwise."""
    try:
        sizes = tuple(int(p) for p in text.split(","))
    except ValueError:
        sizes = ()
    if not sizes or min(sizes) < 1:
        raise ConfigError(f"--scaling {text!r}: expected comma-separated GPU counts >= 1, e.g. 1,2,4,8")
    return sizes


def main_plan(args: argparse.Namespace) -> int:
    cfg = load_config(args.config, list(getattr(args, "overrides", None) or []))
    check_rules(cfg)  # the pipeline's and the speed features' rules (the machine is not the one that trains)
    scaling = None
    if getattr(args, "scaling", None):
        sizes = parse_world_sizes(args.scaling)
        try:
            scaling = predict_scaling(cfg, sizes, gpu=SCALING_GPU)
        except ValueError as err:
            raise ConfigError(f"--scaling: {err}") from err
    inputs = planner_inputs(cfg)  # as recpipe train's pre-flight: plan_from_config
    plan = estimate_memory(inputs)
    problem = check_fits(plan)
    advice = advise(cfg, plan, inputs) if problem is not None else []
    if (getattr(args, "format", None) or "table") == "json":
        doc = plan.to_json()
        doc["advice"] = [a.to_json() for a in advice]
        if scaling is not None:
            doc["scaling"] = scaling
        print(json.dumps(doc, indent=2))
    else:
        print(render_table(plan))
        if scaling is not None:
            print("\n" + render_scaling(scaling))
    if problem is None:
        return 0
    print(f"recpipe plan: the configuration does not fit in GPU memory:\n{problem}\n{advice_lines(advice)}",
          file=sys.stderr)
    return EXIT_DOES_NOT_FIT

