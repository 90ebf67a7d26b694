"""Sections, not the whole config: which functions take ``RecpipeConfig``
(``scripts/config_reach.py`` counts them and states the rule).

The whole config stays at the assembly points: the builder, the trainer, the commands, and
the loaders' entry points below. What they call takes a section (``cfg.data``) or a small
value object built from the config (``recpipe.data.spec.DataSpec``).
"""

from __future__ import annotations

import textwrap

from scripts.config_reach import reach

# The data layer's assembly points: the entry points the trainer, the bench and the preflight
# call (they read the data section with the model's tables, train.device or the sharding's
# kernels), the user's data.factory, whose contract is the whole config, and the one place a
# DataSpec is built. recpipe/data/cli.py is a command: all of it is an assembly point.
DATA_ASSEMBLY_POINTS = {
    "recpipe/data/loader.py": {
        "num_batches", "check_data", "user_batches", "host_memory_tables", "workers_kind_of",
        "workers_description", "size_loader", "with_sized_workers", "make_dataloader",
    },
    "recpipe/data/spec.py": {"DataSpec.from_config"},
}
DATA_COMMANDS = {"recpipe/data/cli.py"}

# The planner's: what builds PlannerInputs from a config, the memory plan of a config, the
# advice (it plans changed configs) and the scaling prediction (it plans the config at each
# world size). Below them the planner takes PlannerInputs or a section.
PLANNER_ASSEMBLY_POINTS = {
    "recpipe/planner/from_config.py": {"planner_inputs", "plan_from_config"},
    "recpipe/planner/inputs.py": {"inputs_from_config"},
    "recpipe/planner/advice.py": {"advise", "_Planner.__init__"},
    "recpipe/planner/scaling.py": {"predict_scaling"},
}

# Functions of recpipe that take the whole config; lower it when a module moves to sections.
MOST_WHOLE_CONFIG_FUNCTIONS = 71


def _check_assembly_points(folder: str, points: dict[str, set[str]], skip: set[str] = frozenset()) -> None:
    found = {path: set(names) for path, names in reach().items() if path.startswith(folder) and path not in skip}
    leaves = {path: names - points.get(path, set()) for path, names in found.items()}
    assert {path: names for path, names in leaves.items() if names} == {}, \
        "take the section or a value object (python scripts/config_reach.py --list)"
    gone = {path: names - found.get(path, set()) for path, names in points.items()}
    assert {path: names for path, names in gone.items() if names} == {}, "no longer assembly points: remove them"


def test_the_data_layer_takes_the_whole_config_only_at_its_assembly_points():
    _check_assembly_points("recpipe/data/", DATA_ASSEMBLY_POINTS, DATA_COMMANDS)


def test_the_planner_takes_the_whole_config_only_at_its_assembly_points():
    _check_assembly_points("recpipe/planner/", PLANNER_ASSEMBLY_POINTS)


def test_the_whole_config_reaches_no_more_functions():
    total = sum(map(len, reach().values()))
    assert total <= MOST_WHOLE_CONFIG_FUNCTIONS, \
        f"{total} functions take the whole config (python scripts/config_reach.py --list)"


def test_the_rule(tmp_path):
    """Annotated with RecpipeConfig, or a ``cfg`` / ``config`` that reads two sections: the
    whole config; a parameter typed by a section, or one that reads one section: not."""
    package = tmp_path / "recpipe"
    package.mkdir()
    (package / "m.py").write_text(textwrap.dedent('''
        def annotated(cfg: RecpipeConfig): ...
        def optional(x: "RecpipeConfig | None" = None): ...
        def two_sections(cfg):
            return cfg.data.batch_size, cfg.model.embedding_dim
        class Reader:
            def __init__(self, config: Any):
                self.n = config.train.seed + config.data.batch_size
        def section(cfg: DataConfig):
            return cfg.data, cfg.model
        def one_section(cfg):
            return cfg.data.batch_size
        def other_name(spec):
            return spec.data, spec.model
        def not_the_config(cfg: RecpipeConfigLike): ...
    '''))
    assert reach(package) == {"recpipe/m.py": ["annotated", "optional", "two_sections", "Reader.__init__"]}
