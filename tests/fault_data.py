"""A ``data.factory`` for tests/test_faults.py: a user's batch factory that yields no
training batch at all (a filter that drops everything, an empty query)."""

from __future__ import annotations

from typing import Iterator


def no_batches(cfg, *, rank: int, world_size: int, split: str, epoch: int, start_batch: int) -> Iterator | None:
    if split == "eval":
        return None  # no eval data either
    return iter(())


def fail_unevenly() -> None:
    """A ``launch_local`` target: rank 0 exits with a code of its own (as a user error
    does), rank 1 raises (as a rank whose collective lost its peer does), so both
    ranks' traceback files exist, and the launcher reports rank 0."""
    import os
    import sys
    import time

    if os.environ["RANK"] == "0":
        sys.exit(5)
    time.sleep(0.5)
    raise RuntimeError("Connection closed by peer")
