"""No module reaches into another's private names, and nothing outside the engine reads the
engine's private fields. ``recpipe train``'s launcher and its ranks import only what they use
before the first step. The import graph (every ``import`` of ``recpipe/``, in functions and
under ``if TYPE_CHECKING:`` too) is ``scripts/import_layers.py``'s; its cycles are checked by
tests/test_layers.py.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

from scripts.import_layers import MODULES, imports, is_exports


def test_no_private_names_across_modules():
    private = [use for module in MODULES for use in imports(module)[1]]
    assert not private, "private names used across modules:\n" + "\n".join(private)


def _engine_private_fields() -> set[str]:
    """The private attributes and methods of the engine's ``Pipeline`` (recpipe/runtime/engine.py)."""
    tree = ast.parse(MODULES["recpipe.runtime.engine"].read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Pipeline")
    names = {f.name for f in cls.body if isinstance(f, ast.FunctionDef)}
    names |= {t.attr for n in ast.walk(cls) if isinstance(n, (ast.Assign, ast.AnnAssign))
              for t in (n.targets if isinstance(n, ast.Assign) else [n.target])
              if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self"}
    return {n for n in names if n.startswith("_") and not n.startswith("__")}


def _reads_of(fields: set[str], module: str) -> list[str]:
    tree = ast.parse(MODULES[module].read_text())
    return [f"{module}:{n.lineno}: .{n.attr}" for n in ast.walk(tree) if isinstance(n, ast.Attribute) and n.attr in fields]


def test_nothing_outside_the_engine_reads_its_private_fields():
    """Steps, pipeline classes, the evaluation and speed features use the engine through
    its step context and public methods (recpipe.runtime.context): 0 reads of the
    engine's private fields anywhere else in the package."""
    fields = _engine_private_fields()
    assert {"_slots", "_recent", "_plan", "_fetch"} <= fields  # the checker sees the engine's state
    reads = [r for m in MODULES if m != "recpipe.runtime.engine" for r in _reads_of(fields, m)]
    assert not reads, f"{len(reads)} reads of the engine's private fields:\n" + "\n".join(reads)


def test_the_checkers_see_type_checking_imports_lazy_names_and_private_reads(tmp_path):
    source = ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from recpipe.config import RecpipeConfig\n"
              "_EXPORTS = {'Pipeline': 'recpipe.runtime.engine'}\n")
    node = ast.parse(source)
    assert is_exports(node.body[2])
    MODULES["recpipe._probe"] = path = tmp_path / "probe.py"
    path.write_text(source + "def f(pipe):\n    return pipe._slots\n")
    try:
        edges, _ = imports("recpipe._probe")
        assert {"recpipe.config", "recpipe.runtime.engine"} <= edges
        assert _reads_of({"_slots"}, "recpipe._probe") == ["recpipe._probe:6: ._slots"]
    finally:
        del MODULES["recpipe._probe"]



ROOT = Path(__file__).resolve().parents[1]
TENSORBOARD = ("tensorboard", "torch.utils.tensorboard")  # imported where rank 0 makes its writer
# The launcher runs no rank: none of the training libraries (nor matplotlib and transformers,
# which torchmetrics imports where they are installed).
TRAINING = ("torchrec", "fbgemm_gpu", "torchmetrics", "matplotlib", "transformers", "recpipe.train.trainer")


def _loaded_after(module: str, names: tuple[str, ...]) -> list[str]:
    """The modules ``names`` and their submodules that importing ``module`` loads, in a fresh process."""
    code = (f"import sys\nimport {module}\n"
            f"print(sorted(m for m in sys.modules if any(m == n or m.startswith(n + '.') for n in {names!r})))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    return ast.literal_eval(out.stdout.strip().splitlines()[-1])


def test_the_launcher_imports_no_training_library():
    """``recpipe train``'s launcher checks the config and starts the ranks, which are forked
    from a server that has imported the trainer (recpipe.launch_preload): its module loads
    torch and the config's libraries only, so a bad config is reported without waiting for
    torchrec (the checks after the config's build the model on meta, with torchrec)."""
    assert _loaded_after("recpipe.train.cli", (*TENSORBOARD, *TRAINING)) == []


def test_the_trainer_imports_no_tensorboard():
    loaded = _loaded_after("recpipe.train.trainer", (*TENSORBOARD, "torchrec"))
    assert "torchrec" in loaded  # the checker sees what is loaded
    assert [m for m in loaded if m.split(".")[0] != "torchrec"] == []


def test_the_command_line_installs_its_signal_handlers_before_importing_a_command():
    """``recpipe.cli`` imports only what ``main`` needs to install the signal handlers: a
    signal in a command's first moments ends it as documented (tests/test_signals.py)."""
    loaded = _loaded_after("recpipe.cli", ("recpipe", "importlib.metadata", "pydantic", "numpy", "torch"))
    assert "recpipe.stop_requests" in loaded  # the checker sees what is loaded
    heavy = [m for m in loaded if m.split(".")[0] in ("pydantic", "numpy", "torch")
             or m in ("importlib.metadata", "recpipe.pipelines", "recpipe.data.cli", "recpipe.config")]
    assert heavy == []
