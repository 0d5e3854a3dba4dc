"""Shared fixtures: the example model repository, built once per test session.

Tests marked ``slow`` are skipped unless pytest runs with ``--run-slow``.
"""

from __future__ import annotations

from pathlib import Path

import pytest


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--run-slow", action="store_true", default=False, help="also run the tests marked slow")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.getoption("--run-slow"):
        return
    skip = pytest.mark.skip(reason="slow: run with --run-slow")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def model_repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A freshly built copy of the example repository (tests may load/unload freely)."""
    from models.build import build_repository

    path = tmp_path_factory.mktemp("models")
    build_repository(path)
    return path
