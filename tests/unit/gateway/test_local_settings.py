"""Tests for the gateway config's ``local`` group (gateway/settings.py, gateway/config.py):
its defaults, its checks, and that it needs the repository it runs."""

from __future__ import annotations

from pathlib import Path

import pytest

from gateway.config import load_config
from gateway.settings import ConfigError, LocalSettings


def test_local_execution_is_off_by_default_and_reads_its_group(tmp_path: Path) -> None:
    assert load_config(None).local == LocalSettings()
    path = tmp_path / "gateway.yaml"
    path.write_text("model_repository: models\nlocal:\n  enabled: true\n  cpu_sessions: shared\n  intra_op_threads: 2\n")
    config = load_config(path)
    assert config.local.enabled and config.local.cpu_sessions == "shared" and config.local.intra_op_threads == 2
    assert config.model_repository == str((tmp_path / "models").resolve())


def test_local_execution_needs_a_repository_and_valid_settings() -> None:
    with pytest.raises(ConfigError, match="local.enabled needs model_repository"):
        load_config(None, local={"enabled": True})
    with pytest.raises(ConfigError, match="local.cpu_sessions"):
        load_config(None, local={"cpu_sessions": "wide"})
    with pytest.raises(ConfigError, match="local.device"):
        load_config(None, local={"device": "tpu"})
    with pytest.raises(ConfigError, match="unknown config key 'local.threads'"):
        load_config(None, local={"threads": 2})
