"""The configs that ship inside the package (recpipe/configs/; the checkout's ``configs/`` is a
link to it), found by name: ``--config quickstart`` is ``recpipe/configs/quickstart.yaml``
when the working directory holds neither ``quickstart`` nor ``quickstart.yaml``. Imports
nothing heavy: the command line resolves ``--config`` with it while parsing."""

from __future__ import annotations

import difflib
import itertools
import re
import textwrap
from pathlib import Path

CONFIG_DIR = Path(__file__).resolve().parent / "configs"


def names() -> list[str]:
    """Every shipped config's name, as ``--config`` takes it: ``quickstart``, ``bench/smoke_cpu``."""
    return sorted(p.relative_to(CONFIG_DIR).with_suffix("").as_posix() for p in CONFIG_DIR.rglob("*.yaml"))


def resolve(config: str) -> str:
    """The file ``config`` names: ``config`` or ``config.yaml`` in the working directory, else
    the shipped config of that name (``quickstart``, ``quickstart.yaml``, ``bench/smoke_cpu``);
    ``config`` unchanged when none exists (loading it then says so)."""
    local = [Path(config)] + ([] if config.endswith(".yaml") else [Path(f"{config}.yaml")])
    shipped = [CONFIG_DIR / p for p in local]
    found = next((p for p in local if p.exists()), None) or next((p for p in shipped if p.is_file()), None)
    return str(found) if found is not None else config


def missing_hint(config: str) -> str:
    """For a ``--config`` that names no file: the closest shipped names, and where to see them all."""
    close = difflib.get_close_matches(Path(config).with_suffix("").as_posix(), names(), n=2)
    guess = f"did you mean {' or '.join(repr(n) for n in close)}? " if close else ""
    return f"{guess}`recpipe configs` lists the shipped configs, which --config takes by name"


def describe(name: str) -> str:
    """The first sentence of the opening comment of shipped config ``name`` (each opens with one)."""
    lines = (CONFIG_DIR / f"{name}.yaml").read_text().splitlines()
    comment = " ".join(line.removeprefix("#").strip() for line in itertools.takewhile(lambda x: x.startswith("#"), lines))
    return re.split(r"(?<=[.;])\s", comment)[0].rstrip(";")


def listing(width: int = 100) -> str:
    """``recpipe configs``: each shipped config's name and what it is for."""
    shown = names()
    indent = max(len(n) for n in shown) + 2
    return "\n".join(textwrap.fill(describe(n), width, initial_indent=n.ljust(indent), subsequent_indent=" " * indent)
                     for n in shown)
