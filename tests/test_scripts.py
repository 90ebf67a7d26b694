"""The example trainer script that subclasses a pipeline runs and its hooks fire."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_custom_pipeline_script_trains_with_its_hooks():
    out = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "custom_pipeline.py"), "--config", str(ROOT / "configs" / "quickstart.yaml"),
         "--set", "train.steps=12", "--set", "data.batch_size=64"],
        capture_output=True, text=True, timeout=300, cwd=ROOT,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    # 12 batches of 64 samples on rank 0, one optimizer step each, a clip per backward
    assert "trained 12 steps, 768 samples on rank 0" in out.stdout, out.stdout
    assert "dense grad norm before clipping" in out.stdout
