"""A refused repository load reworded as Triton's client sees it."""

from __future__ import annotations

import logging

import pytest

from gateway.fleet.repository import _as_load_failure
from protos.errors import InvalidArgument, ModelNotFound, Unavailable


@pytest.mark.parametrize(
    ("message", "client_sees"),
    [
        ("failed to load 'm': model file 3/model.onnx not found", "load failed for model 'm': model file 3/model.onnx not found"),
        ("load failed for model 'm': bad graph", "load failed for model 'm': bad graph"),
        ("version 3: bad graph", "load failed for model 'm': version 3: bad graph"),
        ("Load parameter 'config' must be specified for model file override",
         "failed to load 'm', failed to poll from model repository"),
        ("failed to load 'm', failed to poll from model repository",
         "failed to load 'm', failed to poll from model repository"),
        ("failed to load 'm', failed to poll from model repository: override file path '../x' for model 'm' must be "
         "relative, without '..'",
         "failed to load 'm', failed to poll from model repository: override file path '../x' for model 'm' must be "
         "relative, without '..'"),
        ("explicit model load / unload is not allowed if polling is enabled",
         "explicit model load / unload is not allowed if polling is enabled"),
    ],
    ids=["version-fails", "already-tritons", "bare-cause", "override-without-config", "not-in-repository",
         "worker-poll-failure", "none-mode"],
)
def test_load_failures_in_tritons_words(message: str, client_sees: str, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="gateway.fleet.repository"):
        exc = _as_load_failure(InvalidArgument(message), "m")
    assert isinstance(exc, InvalidArgument) and str(exc) == exc.message == client_sees
    if "config" in message:  # the reason Triton writes only to its log
        assert any(message in r.getMessage() for r in caplog.records)


def test_the_class_and_its_codes_are_kept() -> None:
    assert isinstance(_as_load_failure(ModelNotFound("failed to load 'm', failed to poll from model repository"), "m"),
                      ModelNotFound)
    assert isinstance(_as_load_failure(Unavailable("worker gone"), "m"), Unavailable)
