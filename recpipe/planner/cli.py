"""``recpipe plan --config PATH [--format table|json] [--set KEY=VALUE ...]``.

Prints the memory plan (table or JSON) on stdout. Exit codes: 0 it fits, 3
(``EXIT_DOES_NOT_FIT``) some rank does not fit: stderr names the rank, its capacity
and its largest terms, and what to set to fit (the largest cache load factor, the
fewest prefetch passes) when such a knob exists. A bad config raises
``ConfigError``, which ``recpipe.cli`` turns into exit code 2.
"""

from __future__ import annotations

import argparse
import json
import sys

from recpipe.config import load_config
from recpipe.planner.memory import estimate_memory
from recpipe.planner.plan import check_fits, render_table
from recpipe.planner.search import suggestions
from recpipe.planner.spec import inputs_from_config


def main_plan(args: argparse.Namespace) -> int:
    from recpipe.cli import EXIT_DOES_NOT_FIT

    cfg = load_config(args.config, list(getattr(args, "overrides", None) or []))
    inputs = inputs_from_config(cfg)
    plan = estimate_memory(inputs)
    problem = check_fits(plan)
    hints = [s for s in suggestions(inputs)] if problem is not None else []
    if (getattr(args, "format", None) or "table") == "json":
        doc = plan.to_json()
        doc["suggestions"] = [{"key": s.key, "value": s.value} for s in hints]
        print(json.dumps(doc, indent=2))
    else:
        print(render_table(plan))
    if problem is None:
        return 0
    lines = [f"recpipe plan: the configuration does not fit in GPU memory:", problem]
    lines += [f"  to fit: {s.hint()}" for s in hints]
    print("\n".join(lines), file=sys.stderr)
    return EXIT_DOES_NOT_FIT
