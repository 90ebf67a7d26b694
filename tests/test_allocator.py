"""``train.cuda_alloc_conf``: validated once in the config, given to each process
before CUDA starts, and never over a ``PYTORCH_CUDA_ALLOC_CONF`` the user set."""

from __future__ import annotations

import pytest

from recpipe.config import ConfigError, config_from_dict
from recpipe.distributed import apply_cuda_alloc_conf
from recpipe.system import ALLOC_CONF_ENV


def _cfg(conf):
    return config_from_dict({"train": {"cuda_alloc_conf": conf}}, "test")


def test_default_is_expandable_segments_and_bad_syntax_is_refused():
    assert config_from_dict({}, "test").train.cuda_alloc_conf == "expandable_segments:True"
    assert _cfg("expandable_segments:True,max_split_size_mb:512").train.cuda_alloc_conf.endswith("512")
    assert _cfg(None).train.cuda_alloc_conf is None
    with pytest.raises(ConfigError, match="train.cuda_alloc_conf"):
        _cfg("expandable_segments=True")


def test_applied_unless_the_user_set_it(monkeypatch):
    monkeypatch.delenv(ALLOC_CONF_ENV, raising=False)
    monkeypatch.setattr("torch.cuda.is_initialized", lambda: False)
    assert apply_cuda_alloc_conf(_cfg("expandable_segments:True").train) == "expandable_segments:True"
    import os

    assert os.environ[ALLOC_CONF_ENV] == "expandable_segments:True"
    monkeypatch.setenv(ALLOC_CONF_ENV, "max_split_size_mb:128")
    assert apply_cuda_alloc_conf(_cfg("expandable_segments:True").train) == "max_split_size_mb:128"
    assert os.environ[ALLOC_CONF_ENV] == "max_split_size_mb:128"
    monkeypatch.delenv(ALLOC_CONF_ENV)
    assert apply_cuda_alloc_conf(_cfg(None).train) is None and ALLOC_CONF_ENV not in os.environ


def test_too_late_warns_and_changes_nothing(monkeypatch):
    monkeypatch.delenv(ALLOC_CONF_ENV, raising=False)
    monkeypatch.setattr("torch.cuda.is_initialized", lambda: True)
    with pytest.warns(UserWarning, match="not applied"):
        assert apply_cuda_alloc_conf(_cfg("expandable_segments:True").train) is None
    import os

    assert ALLOC_CONF_ENV not in os.environ
