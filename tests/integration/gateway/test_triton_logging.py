"""Triton's logging extension on a real gateway: ``/v2/logging`` and gRPC
``LogSettings`` read and update one set of settings, and the updates change
what the gateway process writes to its log."""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Iterator

import grpc
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from tests.harness import Proc, start

pytestmark = pytest.mark.timeout(120)

DEFAULTS = {"log_file": "", "log_info": True, "log_warning": True, "log_error": True,
            "log_verbose_level": 0, "log_format": "default"}


@pytest.fixture
def gateway() -> Iterator[Proc]:
    proc = start(["gateway", "--host", "127.0.0.1", "--http-port", "0", "--grpc-port", "0"])
    try:
        yield proc
    finally:
        proc.stop()


def _clients(proc: Proc) -> tuple[httpclient.InferenceServerClient, grpcclient.InferenceServerClient]:
    return (httpclient.InferenceServerClient(f"127.0.0.1:{proc.ready['http_port']}"),
            grpcclient.InferenceServerClient(f"127.0.0.1:{proc.ready['grpc_port']}"))


def _wait_for(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + 20
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)  # polling a condition (the process's log), not standing in for readiness


def test_settings_read_and_update_over_both_protocols(gateway: Proc) -> None:
    http, grpc_client = _clients(gateway)
    try:
        assert http.get_log_settings() == DEFAULTS
        assert "logging" in http.get_server_metadata()["extensions"]
        grpc_client.update_log_settings({"log_warning": False, "log_verbose_level": 2})
        assert http.get_log_settings() == dict(DEFAULTS, log_warning=False, log_verbose_level=2)
        answer = http.update_log_settings({"log_warning": True, "log_verbose_level": 0, "log_format": "ISO8601"})
        assert answer == dict(DEFAULTS, log_format="ISO8601")
        settings = grpc_client.get_log_settings(as_json=True)["settings"]
        assert settings["log_format"] == {"string_param": "ISO8601"}
        assert settings["log_info"] == {"bool_param": True}
    finally:
        http.close()
        grpc_client.close()


def test_updates_change_what_the_process_logs(gateway: Proc) -> None:
    http, grpc_client = _clients(gateway)
    # An unknown model is logged at DEBUG by the error edge: visible only with verbose logging.
    marker = "no-such-model-for-log-test"
    try:
        with pytest.raises(InferenceServerException):
            http.get_model_metadata(marker)
        http.update_log_settings({"log_verbose_level": 1, "log_format": "ISO8601"})
        assert marker not in gateway.log()
        with pytest.raises(InferenceServerException):
            http.get_model_metadata(marker + "-2")
        _wait_for(lambda: marker + "-2" in gateway.log(), "the DEBUG line")
        line = next(ln for ln in gateway.log().splitlines() if marker + "-2" in ln)
        assert re.match(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ DEBUG ", line), line
    finally:
        http.close()
        grpc_client.close()


def test_refusals_in_tritons_words(gateway: Proc) -> None:
    http, grpc_client = _clients(gateway)
    try:
        with pytest.raises(InferenceServerException, match="log file location can not be updated through network"):
            http.update_log_settings({"log_file": "/tmp/x.log"})
        with pytest.raises(InferenceServerException, match="invalid argument for --log_format, got: xml"):
            http.update_log_settings({"log_format": "xml"})
        with pytest.raises(InferenceServerException) as info:
            grpc_client.update_log_settings({"log_file": "/tmp/x.log"})
        assert info.value.status() == str(grpc.StatusCode.UNIMPLEMENTED)
        with pytest.raises(InferenceServerException) as info:
            grpc_client.update_log_settings({"log_format": "xml"})
        assert info.value.status() == str(grpc.StatusCode.INVALID_ARGUMENT)
        assert http.get_log_settings() == DEFAULTS  # a refused update changes nothing
    finally:
        http.close()
        grpc_client.close()
