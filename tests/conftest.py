"""Shared fixtures: the example model repository, built once per test session."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def model_repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A freshly built copy of the example repository (tests may load/unload freely)."""
    from models.build import build_repository

    path = tmp_path_factory.mktemp("models")
    build_repository(path)
    return path
