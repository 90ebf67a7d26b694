"""docs/configuration.md is generated from recpipe/config.py (scripts/gen_config_docs.py):
the committed page must equal the generator's output, so it cannot drift from the code."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from recpipe.config import RecpipeConfig

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "configuration.md"


def _generator():
    spec = importlib.util.spec_from_file_location("gen_config_docs", ROOT / "scripts" / "gen_config_docs.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_configuration_page_is_the_generated_one():
    generated = _generator().render()
    assert PAGE.read_text() == generated, (
        "docs/configuration.md is out of date with recpipe/config.py; regenerate it with\n"
        "    python scripts/gen_config_docs.py > docs/configuration.md"
    )


def _keys(model, prefix=""):
    for name, field in model.model_fields.items():
        ann, key = field.annotation, field.alias or name  # pipeline.class: ``class_`` in code
        if isinstance(ann, type) and hasattr(ann, "model_fields"):
            yield from _keys(ann, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}"


def test_every_key_of_every_section_is_on_the_page():
    page = _generator().render()
    for key in _keys(RecpipeConfig):
        if key.startswith(("pipeline", "sharding.tables")):
            continue  # a union of pipelines and a map of tables: checked below
        assert f"| `{key}` |" in page, key
    from recpipe.pipeline_options import options_of
    from recpipe.pipelines.registry import PIPELINES

    for definition in PIPELINES.values():  # every option of every pipeline, nested sections' keys included
        for key in _keys(options_of(definition), "pipeline."):
            assert f"| `{key}` |" in page, key
    assert "| `sharding.default.type` |" in page
    assert "## sharding.tables.&lt;table&gt;" in page
