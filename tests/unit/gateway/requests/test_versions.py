"""A request's model version string read as Triton reads it (``std::stol``),
and Triton's words for one it cannot read."""

from __future__ import annotations

import pytest

from gateway.requests.versions import model_version
from protos.errors import InvalidArgument


@pytest.mark.parametrize(
    ("text", "version"),
    [("", ""), ("1", "1"), ("12", "12"), ("007", "7"), (" 3", "3"), ("3abc", "3"), ("+2", "2"), ("0", "0"),
     ("9223372036854775807", "9223372036854775807")],
)
def test_versions_read_as_stol_reads_them(text: str, version: str) -> None:
    assert model_version(text) == version


@pytest.mark.parametrize("text", ["abc", "v1", "99999999999999999999", "-"])
def test_unreadable_version_is_invalid_argument_in_tritons_words(text: str) -> None:
    with pytest.raises(InvalidArgument) as info:
        model_version(text)
    assert info.value.grpc_code.name == "INVALID_ARGUMENT" and info.value.http_status == 400
    assert str(info.value) == (
        f"failed to get model version from specified version string '{text}' (details: stol), "
        "version should be an integral value > 0"
    )


def test_negative_version_in_tritons_words() -> None:
    with pytest.raises(InvalidArgument) as info:
        model_version("-1")
    assert str(info.value) == "invalid model version specified '-1' , version should be an integral value > 0"
