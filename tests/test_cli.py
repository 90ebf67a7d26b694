"""The command line's own surface: ``recpipe --version`` and help texts (CPU, no model built).

Every subcommand (nested ones too) must have a one-line help in its parent's listing and a
description of its own; every argument must have a help text; every option whose default means
something must show it in ``--help``.
"""

from __future__ import annotations

import argparse
import ast
import subprocess
import sys
from pathlib import Path

import pytest

import recpipe
from recpipe.cli import build_parser, main, version
from recpipe.system import may_have_gpu

ROOT = Path(__file__).resolve().parents[1]


def _walk(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()):
    """Yield (command path, parser, the help its parent lists for it) for the tree below ``parser``."""
    yield path, parser, None
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            listed = {a.dest: a.help for a in action._choices_actions}
            for name, child in action.choices.items():
                for sub_path, sub_parser, sub_listed in _walk(child, path + (name,)):
                    yield sub_path, sub_parser, listed.get(name) if sub_path == path + (name,) else sub_listed


def _commands():
    return list(_walk(build_parser()))


def test_version_prints_the_package_version_and_exits_0(capsys):
    with pytest.raises(SystemExit) as stop:
        main(["--version"])
    assert stop.value.code == 0
    out = capsys.readouterr().out.strip()
    assert out == version()
    assert out.startswith("recpipe ")
    # from the installed metadata, else the package's own attribute: both are the same version
    assert out.split()[1] == recpipe.__version__
    assert "torch " in out


def test_version_from_the_command_line():
    out = subprocess.run([sys.executable, "-m", "recpipe", "--version"], capture_output=True, text=True,
                         timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith(f"recpipe {recpipe.__version__}")


def test_the_tree_has_every_command():
    paths = {" ".join(p) for p, _, _ in _commands()}
    for expected in ("train", "plan", "schedule", "bench", "data", "data convert", "data verify", "data bench",
                     "checkpoint"):
        assert expected in paths, sorted(paths)


@pytest.mark.parametrize("path", [p for p, _, _ in _commands()], ids=lambda p: " ".join(p) or "recpipe")
def test_every_command_and_argument_has_help(path):
    parser, listed = next((parser, listed) for p, parser, listed in _commands() if p == path)
    where = "recpipe " + " ".join(path)
    assert parser.description and parser.description.strip(), f"{where}: no description"
    assert "``" not in parser.description, f"{where}: reST markup in its description"
    if path:
        assert listed and listed.strip(), f"{where}: no one-line help in its parent's command list"
    text = parser.format_help()
    assert "``" not in text, f"{where}: reST markup in --help"
    for action in parser._actions:
        if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)):
            continue
        name = "/".join(action.option_strings) or action.dest
        assert action.help and action.help.strip() and action.help is not argparse.SUPPRESS, f"{where} {name}: no help"
        shows_default = action.option_strings and action.default not in (None, False, [], argparse.SUPPRESS) \
            and not isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction, argparse._VersionAction))
        if shows_default:
            shown = parser._get_formatter()._get_help_string(action) % {"default": action.default}
            assert "default" in shown and str(action.default) in shown, f"{where} {name}: default not shown"
            assert str(action.default) in text


def _option_help(path: tuple[str, ...], flag: str) -> str:
    parser = next(p for command, p, _ in _commands() if command == path)
    action = next(a for a in parser._actions if flag in a.option_strings)
    return " ".join(parser._get_formatter()._format_action(action).split())


@pytest.mark.parametrize("flag,default", [("--steps", 100), ("--warmup", 20), ("--rounds", 1), ("--trace-steps", 5)])
def test_bench_help_shows_defaults(flag, default):
    assert f"(default: {default})" in _option_help(("bench",), flag)


def test_plan_format_has_help_and_default():
    text = _option_help(("plan",), "--format")
    assert "json" in text and "(default: table)" in text


HEAVY = ("torchrec", "fbgemm_gpu")


def _loaded_by(argv: list[str], packages: tuple[str, ...]) -> list[str]:
    """The modules of ``packages`` that ``recpipe <argv>`` loads, run in a fresh process."""
    code = ("import sys\nimport recpipe.cli\ntry:\n    code = recpipe.cli.main(sys.argv[1:])\nexcept SystemExit as stop:\n"
            "    code = stop.code\nloaded = sorted(m for m in sys.modules if m.split('.')[0] in %r)\n"
            "print('LOADED', loaded, file=sys.stderr)\nsys.exit(code)" % (packages,))
    out = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("LOADED "), out.stderr[-3000:]
    return ast.literal_eval(last.removeprefix("LOADED "))


@pytest.mark.parametrize("argv", [["--version"], ["--help"], ["schedule", "sparse_dist"], ["schedule", "all"],
                                  ["plan", "--config", "configs/quickstart.yaml"],
                                  ["plan", "--config", "configs/dcnv2.yaml", "--format", "json"]],
                         ids=lambda argv: " ".join(argv[:2]))
def test_cheap_commands_load_neither_torchrec_nor_fbgemm(argv):
    """The config, the registries, the schedules and the planner are data: printing a version,
    the help, a schedule or a memory plan (of the built-in model) imports neither."""
    assert _loaded_by(argv, HEAVY) == []


@pytest.mark.parametrize("config", ["quickstart.yaml", "dcnv2.yaml"])
def test_plan_imports_no_torch(config):
    """``recpipe plan`` of the built-in model imports no torch (0.4 s instead of 2.2 s on a
    2-core machine). Where the machine shows a GPU, the plan reads the GPU's memory through
    torch unless ``sharding.hbm_gb`` gives it: given here."""
    gpu = ["--set", "sharding.hbm_gb=80"] if may_have_gpu() else []
    assert _loaded_by(["plan", "--config", f"configs/{config}", *gpu], ("torch", *HEAVY)) == []


def test_the_config_imports_without_torch():
    """``python -X importtime -c "import recpipe.config"``: pydantic and PyYAML, no torch."""
    out = subprocess.run([sys.executable, "-X", "importtime", "-c", "import recpipe.config"], capture_output=True,
                         text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    imported = {line.rsplit("|", 1)[-1].strip() for line in out.stderr.splitlines() if line.startswith("import time:")}
    assert "recpipe.config" in imported and "pydantic" in imported
    assert not {m for m in imported if m.split(".")[0] in ("torch", *HEAVY)}, sorted(imported)


@pytest.mark.slow
def test_the_train_launcher_never_imports_what_only_ranks_use(tmp_path):
    """A whole ``recpipe train`` run: its ranks write the metrics and TensorBoard; the launcher,
    which checks the config and starts them, loads neither torchmetrics, TensorBoard nor what
    those import where installed (matplotlib, transformers)."""
    argv = ["train", "--config", "configs/quickstart.yaml", "--set", "train.steps=2", "--set", "train.log_every=1",
            "--set", f"logging.run_dir={tmp_path / 'run'}", "--set", f"checkpoint.dir={tmp_path / 'ckpt'}"]
    assert _loaded_by(argv, ("torchmetrics", "tensorboard", "matplotlib", "transformers")) == []
    assert list((tmp_path / "run").glob("events.out.tfevents.*"))  # rank 0 wrote TensorBoard's events
