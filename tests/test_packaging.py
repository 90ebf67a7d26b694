"""What ``pip install recpipe[cpu]`` / ``[gpu]`` gets: the wheel names the stack recpipe is tested
with as extras and carries the shipped configs, which ``--config`` finds by name anywhere."""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
import zipfile
from email.parser import Parser
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from recpipe import fbgemm_build, shipped_configs
from recpipe.cli import main
from recpipe.exit_codes import EXIT_BAD_CONFIG

ROOT = Path(__file__).resolve().parents[1]
# The GPU machines' stack (docs/install.md); the CPU one is scripts/versions.env.
GPU_STACK = {"torch": "2.11.0", "fbgemm-gpu": "1.6.0", "torchrec": "1.6.1"}
# Import names that differ from the distribution that provides them.
DISTRIBUTION_OF = {"yaml": "pyyaml", "fbgemm_gpu": "fbgemm-gpu"}
CHECKOUT_CONFIGS = sorted(p.relative_to(ROOT / "configs").as_posix() for p in (ROOT / "configs").rglob("*.yaml"))


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The wheel built from a copy of the project (the build leaves nothing in the checkout)."""
    src, out = tmp_path_factory.mktemp("src"), tmp_path_factory.mktemp("wheel")
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(ROOT / name, src / name)
    shutil.copytree(ROOT / "recpipe", src / "recpipe", ignore=shutil.ignore_patterns("__pycache__"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q",
                    "-w", str(out), str(src)], check=True, timeout=300, capture_output=True)
    return next(out.glob("recpipe-*.whl"))


def _metadata(wheel: Path):
    with zipfile.ZipFile(wheel) as z:
        name = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        return Parser().parsestr(z.read(name).decode())


def test_wheel_declares_the_cpu_and_gpu_stacks_as_extras(wheel):
    meta = _metadata(wheel)
    assert set(meta.get_all("Provides-Extra")) >= {"cpu", "gpu"}
    needs = meta.get_all("Requires-Dist")
    for extra in ("cpu", "gpu"):
        stack = {r.split(";")[0].replace(" ", "") for r in needs if f'extra == "{extra}"' in r}
        # the GPU machines' stack (torch 2.11, fbgemm-gpu 1.6.0, torchrec 1.6.1) and the CPU one
        # (scripts/versions.env: 2.13.0, 1.8.0, 1.8.0) both fall in these ranges
        assert {"torch<2.14,>=2.11", "fbgemm-gpu<1.9,>=1.6.0", "torchrec<1.9,>=1.6.1"} <= stack, (extra, stack)


def _versions_env() -> dict[str, str]:
    pairs = (line.split("=", 1) for line in (ROOT / "scripts" / "versions.env").read_text().splitlines()
             if "=" in line and not line.startswith("#"))
    return {key: value.strip('"') for key, value in pairs}


def _requirements(wheel: Path, extra: str | None) -> dict[str, Requirement]:
    reqs = (Requirement(line) for line in _metadata(wheel).get_all("Requires-Dist"))
    env = {"extra": extra or ""}
    return {r.name: r for r in reqs if (r.marker is None and extra is None)
            or (r.marker is not None and extra is not None and r.marker.evaluate(env))}


@pytest.mark.parametrize("extra", ["cpu", "gpu"])
def test_the_extras_admit_the_tested_stacks(wheel, extra):
    """Both stacks recpipe is tested with fall in each extra's ranges, so a fresh install resolves
    to a tested stack and an existing tested one is kept."""
    pinned = _versions_env()
    cpu_stack = {"torch": pinned["TORCH_VERSION"], "fbgemm-gpu": pinned["FBGEMM_VERSION"],
                 "torchrec": pinned["TORCHREC_VERSION"]}
    needs = _requirements(wheel, extra)
    for stack in (cpu_stack, GPU_STACK):
        for name, version in stack.items():
            assert name in needs, (extra, name, sorted(needs))
            assert needs[name].specifier.contains(version), (extra, name, version, str(needs[name].specifier))


def _module_level_imports(tree: ast.Module):
    """Top-level names imported when a module loads (imports inside functions and try blocks are
    optional features: wandb, triton)."""
    for node in tree.body:
        if isinstance(node, ast.Import):
            yield from ((a.name.split(".")[0], node.lineno) for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            yield node.module.split(".")[0], node.lineno
        elif isinstance(node, ast.If) and "TYPE_CHECKING" not in ast.unparse(node.test):
            yield from _module_level_imports(ast.Module(body=node.body + node.orelse, type_ignores=[]))


def test_every_module_level_import_is_a_declared_need(wheel):
    """What the package imports on load is installed by `pip install recpipe[cpu]`: the standard
    library, the dependencies, the extras' stack; nothing a checkout has only for development."""
    declared = set(_requirements(wheel, None)) | set(_requirements(wheel, "cpu"))
    undeclared = []
    for path in sorted((ROOT / "recpipe").rglob("*.py")):
        for module, line in _module_level_imports(ast.parse(path.read_text())):
            if module in sys.stdlib_module_names or module == "recpipe":
                continue
            if DISTRIBUTION_OF.get(module, module) not in declared:
                undeclared.append(f"{path.relative_to(ROOT)}:{line} imports {module}")
    assert not undeclared, undeclared


def test_wheel_ships_every_config_of_the_checkout(wheel):
    with zipfile.ZipFile(wheel) as z:
        shipped = sorted(n.removeprefix("recpipe/configs/") for n in z.namelist()
                         if n.startswith("recpipe/configs/") and n.endswith(".yaml"))
    assert "quickstart.yaml" in shipped and shipped == CHECKOUT_CONFIGS


def test_checkout_configs_are_the_shipped_ones():
    """One copy of each file: the checkout's configs/ is a link to the package's."""
    assert (ROOT / "configs").is_symlink() and (ROOT / "configs").resolve() == shipped_configs.CONFIG_DIR


def test_config_by_name_outside_the_checkout(tmp_path):
    out = subprocess.run([sys.executable, "-m", "recpipe", "plan", "--config", "quickstart"], cwd=tmp_path,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "t_cat_0" in out.stdout


def test_a_file_in_the_working_directory_wins_over_a_shipped_config(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert shipped_configs.resolve("quickstart") == str(shipped_configs.CONFIG_DIR / "quickstart.yaml")
    assert shipped_configs.resolve("bench/smoke_cpu") == str(shipped_configs.CONFIG_DIR / "bench" / "smoke_cpu.yaml")
    (tmp_path / "quickstart.yaml").write_text("# mine\n")
    assert shipped_configs.resolve("quickstart") == "quickstart.yaml"
    assert shipped_configs.resolve("quickstart.yaml") == "quickstart.yaml"
    assert shipped_configs.resolve("nope") == "nope"


def test_configs_lists_every_shipped_config(capsys):
    assert main(["configs"]) == 0
    out = capsys.readouterr().out
    for name in CHECKOUT_CONFIGS:
        assert name.removesuffix(".yaml") in out
    assert "quickstart   " in out and "Quickstart: DLRM on synthetic click data" in out


def test_a_config_that_is_neither_a_file_nor_shipped_names_the_closest(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["plan", "--config", "quickstrat"]) == EXIT_BAD_CONFIG
    err = capsys.readouterr().err
    assert "'quickstrat' does not exist (did you mean 'quickstart'" in err and "recpipe configs" in err


@pytest.mark.skipif(fbgemm_build.has_nvidia_driver(), reason="needs a machine without the NVIDIA driver")
@pytest.mark.parametrize("command", [["train", "--config", "quickstart"], ["export", "--config", "quickstart",
                                                                         "--checkpoint", "ckpt", "--out", "m.pt"]])
def test_a_cuda_fbgemm_without_the_driver_is_one_line(tmp_path, command):
    """PyPI's fbgemm-gpu is the CUDA build: where it cannot load, the command says what to install
    before any process starts, instead of every process failing to load it."""
    fake = tmp_path / "site" / "fbgemm_gpu"
    (fake / "docs").mkdir(parents=True)
    (fake / "__init__.py").write_text("raise OSError('libnvidia-ml.so.1: cannot open shared object file')\n")
    (fake / "docs" / "target.default.json.py").write_text('{"version": "1.8.0", "target": "default", '
                                                         '"variant": "cuda"}\n')
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(fake.parent), str(ROOT)])}
    out = subprocess.run([sys.executable, "-m", "recpipe", *command], cwd=tmp_path, env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == EXIT_BAD_CONFIG, out.stderr[-3000:]
    assert out.stderr.strip().splitlines() == [
        f"recpipe {command[0]}: the installed fbgemm-gpu 1.8.0 is its CUDA build, which needs the NVIDIA driver "
        "(libnvidia-ml.so.1 is not found); without a GPU install its CPU build: pip install 'recpipe[cpu]' "
        "--extra-index-url https://download.pytorch.org/whl/cpu, or from PyPI alone: pip uninstall -y fbgemm-gpu "
        f"&& pip install fbgemm-gpu-cpu==1.8.0 (docs/install.md) [exit {EXIT_BAD_CONFIG}]"]


def test_the_installed_cpu_build_passes_the_check():
    target = fbgemm_build.fbgemm_target()
    assert target.get("variant") in ("cpu", "cuda"), target  # the record fbgemm-gpu's own import reads
    fbgemm_build.check_fbgemm_build()  # the stack the tests run on can train
