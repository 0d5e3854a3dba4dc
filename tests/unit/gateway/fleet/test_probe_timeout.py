"""``probe.timeout_s``: how long one probe of a worker may take before it counts
as failed. A worker that is alive but unreachable (a cut link: no reset, no
refusal) is found only by this timeout, so it must be tunable."""

from __future__ import annotations

from pathlib import Path

import pytest

from gateway.composition import build_gateway
from gateway.config import load_config
from gateway.settings import ConfigError


def test_probe_timeout_is_read_from_the_config(tmp_path: Path) -> None:
    path = tmp_path / "gateway.yaml"
    path.write_text("probe:\n  timeout_s: 0.75\n")
    config = load_config(path)
    assert config.probe.timeout_s == 0.75
    assert build_gateway(config).cluster._probe_timeout_s == 0.75  # what each probe is bounded by


def test_probe_timeout_defaults_to_five_seconds() -> None:
    assert load_config(None).probe.timeout_s == 5.0


@pytest.mark.parametrize("value", [0, -1])
def test_probe_timeout_must_be_positive(tmp_path: Path, value: float) -> None:
    path = tmp_path / "gateway.yaml"
    path.write_text(f"probe:\n  timeout_s: {value}\n")
    with pytest.raises(ConfigError, match="probe.timeout_s"):
        load_config(path)
