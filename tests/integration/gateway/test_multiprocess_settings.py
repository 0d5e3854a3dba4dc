"""Triton's extension state behind several gateway processes (``--processes 2``):
system shared memory, log settings and trace settings, changed through any
process, hold in every process when the call returns.

Real processes: an ONNX Runtime worker serving ``simple`` (INT32 [16] x2 ->
sum and difference), a 2-process gateway, the stock ``tritonclient`` (HTTP
and gRPC) with ``tritonclient.utils.shared_memory``. Each call goes over a
fresh connection, so the kernel spreads them over both processes. Which
process answered an HTTP call is in its ``X-Infergate-Process`` header; which
process served an inference is read from the per-process request counter of
``/metrics`` (``infergate_process_requests``) around it.
"""

from __future__ import annotations

import json
import os
import urllib.error
import urllib.request
import uuid
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from tests.harness import Proc, start, start_worker, worker_url
from tests.integration.gateway.test_multiprocess import FAST, fetch, from_every_process, samples, until

with warnings.catch_warnings():  # it imports pkg_resources, deprecated by setuptools
    warnings.simplefilter("ignore", UserWarning)
    import tritonclient.utils.shared_memory as shm

pytestmark = pytest.mark.timeout(240)

BYTES = 16 * 4  # one INT32 [1, 16] tensor
ATTEMPTS = 200  # fresh connections tried before concluding a process never answers


@pytest.fixture(scope="module")
def gateway(model_repo: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proc]:
    worker = start_worker(model_repo, "--model-control-mode", "explicit")
    proc = None
    try:
        path = tmp_path_factory.mktemp("mpset") / "gateway.yaml"
        path.write_text(FAST + "models:\n  simple: {replicas: 1}\n")
        proc = start(["gateway", "--worker", worker_url(worker), "--http-port", "0", "--grpc-port", "0",
                      "--config", str(path), "--processes", "2"])
        http = httpclient.InferenceServerClient(http_url(proc))
        try:
            until(lambda: http.is_model_ready("simple"), "simple placed")
        finally:
            http.close()
        yield proc
    finally:
        if proc is not None:
            proc.stop()
        worker.stop()


def http_url(gateway: Proc) -> str:
    return f"127.0.0.1:{gateway.ready['http_port']}"


def grpc_url(gateway: Proc) -> str:
    return f"127.0.0.1:{gateway.ready['grpc_port']}"


def _fresh_call(client: Any, call: Callable[[Any], Any]) -> Any:
    """``call`` on a client of its own (a fresh connection or channel: any process may take it), then closed."""
    try:
        return call(client)
    finally:
        client.close()


def http_call(gateway: Proc, call: Callable[[httpclient.InferenceServerClient], Any]) -> Any:
    return _fresh_call(httpclient.InferenceServerClient(http_url(gateway)), call)


def grpc_call(gateway: Proc, call: Callable[[grpcclient.InferenceServerClient], Any]) -> Any:
    return _fresh_call(grpcclient.InferenceServerClient(grpc_url(gateway)), call)


def post(gateway: Proc, path: str, doc: Any) -> tuple[str, int, Any]:
    """(answering process, status, JSON body or error text) of one POST over a fresh connection."""
    request = urllib.request.Request(f"http://{http_url(gateway)}{path}", data=json.dumps(doc).encode(),
                                     headers={"Content-Type": "application/json"}, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=30) as r:
            body = r.read()
            return r.headers["X-Infergate-Process"], r.status, json.loads(body) if body else None
    except urllib.error.HTTPError as e:
        return e.headers["X-Infergate-Process"], e.code, json.loads(e.read())["error"]


def post_through_every_process(gateway: Proc, path: str, doc: Any) -> dict[str, tuple[int, Any]]:
    """The same POST sent until each process has answered it once: process -> (status, body)."""
    answers: dict[str, tuple[int, Any]] = {}
    for _ in range(ATTEMPTS):
        process, status, body = post(gateway, path, doc)
        answers.setdefault(process, (status, body))
        if len(answers) == 2:
            return answers
    raise AssertionError(f"only processes {sorted(answers)} answered POST {path}")


def every_process_answers(gateway: Proc, path: str) -> Any:
    """The one JSON document every process answers ``GET path`` with."""
    docs = {process: [json.loads(b) for b in bodies] for process, bodies in from_every_process(gateway, path).items()}
    first = docs["0"][0]
    assert all(doc == first for bodies in docs.values() for doc in bodies), docs
    return first


def served_counts(gateway: Proc) -> dict[str, float]:
    text = fetch(gateway, "/metrics")[1].decode()
    return {dict(labels)["process"]: n for labels, n in samples(text, "infergate_process_requests").items()}


def served_by_every_process(gateway: Proc, infer: Callable[[], None]) -> None:
    """Run ``infer`` (one request, on a fresh connection) until each process has served one; each must succeed."""
    served: set[str] = set()
    for _ in range(ATTEMPTS):
        before = served_counts(gateway)
        infer()
        after = served_counts(gateway)
        served |= {p for p in after if after[p] > before.get(p, 0)}
        if served == {"0", "1"}:
            return
    raise AssertionError(f"only processes {sorted(served)} served an inference")


# ---- system shared memory ------------------------------------------------------------


class Regions:
    """Triton's example pair of regions: inputs (INPUT0 then INPUT1) and outputs (OUTPUT0 then OUTPUT1)."""

    def __init__(self) -> None:
        tag = f"{os.getpid()}_{uuid.uuid4().hex[:8]}"
        self.in_key, self.out_key = f"/infergate_mp_in_{tag}", f"/infergate_mp_out_{tag}"
        self.input0, self.input1 = np.arange(16, dtype=np.int32), np.full(16, 3, dtype=np.int32)
        self.in_handle = shm.create_shared_memory_region("input_data", self.in_key, BYTES * 2)
        self.out_handle = shm.create_shared_memory_region("output_data", self.out_key, BYTES * 2)
        shm.set_shared_memory_region(self.in_handle, [self.input0, self.input1])

    def clear_outputs(self) -> None:
        shm.set_shared_memory_region(self.out_handle, [np.zeros(32, dtype=np.int32)])

    def check_outputs(self) -> None:
        out = shm.get_contents_as_numpy(self.out_handle, np.int32, [32])
        assert out[:16].tolist() == (self.input0 + self.input1).tolist()
        assert out[16:].tolist() == (self.input0 - self.input1).tolist()

    def status(self) -> list[dict[str, Any]]:
        return [{"name": "input_data", "key": self.in_key, "offset": 0, "byte_size": BYTES * 2},
                {"name": "output_data", "key": self.out_key, "offset": 0, "byte_size": BYTES * 2}]

    def destroy(self) -> None:
        shm.destroy_shared_memory_region(self.in_handle)
        shm.destroy_shared_memory_region(self.out_handle)


@pytest.fixture
def regions(gateway: Proc) -> Iterator[Regions]:
    r = Regions()
    try:
        yield r
    finally:
        http_call(gateway, lambda c: c.unregister_system_shared_memory())
        r.destroy()


def shm_request(module: Any) -> dict[str, list[Any]]:
    inputs = [module.InferInput("INPUT0", [1, 16], "INT32"), module.InferInput("INPUT1", [1, 16], "INT32")]
    inputs[0].set_shared_memory("input_data", BYTES)
    inputs[1].set_shared_memory("input_data", BYTES, offset=BYTES)
    outputs = [module.InferRequestedOutput("OUTPUT0"), module.InferRequestedOutput("OUTPUT1")]
    outputs[0].set_shared_memory("output_data", BYTES)
    outputs[1].set_shared_memory("output_data", BYTES, offset=BYTES)
    return {"inputs": inputs, "outputs": outputs}


def listed(gateway: Proc) -> list[dict[str, Any]]:
    return sorted(every_process_answers(gateway, "/v2/systemsharedmemory/status"), key=lambda r: r["name"])


def test_a_region_registered_through_http_is_known_to_every_process(gateway: Proc, regions: Regions) -> None:
    http_call(gateway, lambda c: c.register_system_shared_memory("input_data", regions.in_key, BYTES * 2))
    http_call(gateway, lambda c: c.register_system_shared_memory("output_data", regions.out_key, BYTES * 2))
    assert listed(gateway) == regions.status()

    def infer() -> None:
        regions.clear_outputs()
        http_call(gateway, lambda c: c.infer("simple", **shm_request(httpclient)))
        regions.check_outputs()

    served_by_every_process(gateway, infer)

    # Refusals are the same whichever process answers, and change nothing anywhere.
    path = "/v2/systemsharedmemory/region/input_data/register"
    again = post_through_every_process(gateway, path, {"key": regions.in_key, "byte_size": BYTES})
    assert {a for a in again.values()} == {(400, "shared memory region 'input_data' already in manager")}
    missing = post_through_every_process(gateway, "/v2/systemsharedmemory/region/nokey/register",
                                         {"key": "/infergate_mp_none", "byte_size": BYTES})
    assert {a for a in missing.values()} == {(400, "Unable to open shared memory region: '/infergate_mp_none'")}
    assert listed(gateway) == regions.status()

    # Unregistered through any process: gone from every process.
    _, status, _ = post(gateway, "/v2/systemsharedmemory/region/input_data/unregister", {})
    assert status == 200
    assert listed(gateway) == regions.status()[1:]
    for answered, (status, error) in post_through_every_process(gateway, "/v2/models/simple/infer", {
        "inputs": [{"name": n, "shape": [1, 16], "datatype": "INT32",
                    "parameters": {"shared_memory_region": "input_data", "shared_memory_byte_size": BYTES}}
                   for n in ("INPUT0", "INPUT1")],
    }).items():
        assert (status, error) == (404, "Unable to find shared memory region: 'input_data'"), answered
    http_call(gateway, lambda c: c.unregister_system_shared_memory())
    assert listed(gateway) == []


def test_a_region_registered_through_grpc_is_known_to_every_process(gateway: Proc, regions: Regions) -> None:
    # Several rounds over fresh channels: registrations land on both processes.
    for _ in range(4):
        grpc_call(gateway, lambda c: c.register_system_shared_memory("input_data", regions.in_key, BYTES * 2))
        grpc_call(gateway, lambda c: c.register_system_shared_memory("output_data", regions.out_key, BYTES * 2))
        assert listed(gateway) == regions.status()
        for _ in range(4):
            status = grpc_call(gateway, lambda c: c.get_system_shared_memory_status()).regions
            assert {name: (r.key, r.byte_size) for name, r in status.items()} == {
                "input_data": (regions.in_key, BYTES * 2), "output_data": (regions.out_key, BYTES * 2)}

        def infer() -> None:
            regions.clear_outputs()
            grpc_call(gateway, lambda c: c.infer("simple", **shm_request(grpcclient)))
            regions.check_outputs()

        served_by_every_process(gateway, infer)
        for _ in range(4):  # a second registration is refused by whichever process takes it
            with pytest.raises(InferenceServerException, match="'output_data' already in manager"):
                grpc_call(gateway, lambda c: c.register_system_shared_memory("output_data", regions.out_key, BYTES))
        grpc_call(gateway, lambda c: c.unregister_system_shared_memory())
        assert listed(gateway) == []
        for _ in range(4):
            assert not grpc_call(gateway, lambda c: c.get_system_shared_memory_status()).regions


# ---- log settings ---------------------------------------------------------------------


@pytest.fixture
def log_defaults(gateway: Proc) -> Iterator[dict[str, Any]]:
    defaults = every_process_answers(gateway, "/v2/logging")
    yield defaults
    http_call(gateway, lambda c: c.update_log_settings({k: v for k, v in defaults.items() if k != "log_file"}))


def test_log_settings_updated_through_any_process_hold_in_every_process(
    gateway: Proc, log_defaults: dict[str, Any]
) -> None:
    assert log_defaults["log_verbose_level"] == 0 and log_defaults["log_format"] == "default"
    for process, (status, answer) in post_through_every_process(gateway, "/v2/logging", {
            "log_verbose_level": 1, "log_format": "ISO8601"}).items():
        assert status == 200 and answer == {**log_defaults, "log_verbose_level": 1, "log_format": "ISO8601"}, process
    assert every_process_answers(gateway, "/v2/logging") == answer

    grpc_call(gateway, lambda c: c.update_log_settings({"log_info": False, "log_verbose_level": 0}))
    expected = {**answer, "log_info": False, "log_verbose_level": 0}
    assert every_process_answers(gateway, "/v2/logging") == expected
    for _ in range(4):
        settings = grpc_call(gateway, lambda c: c.get_log_settings(as_json=True))["settings"]
        assert settings["log_info"] == {"bool_param": False} and settings["log_format"] == {"string_param": "ISO8601"}

    refused = post_through_every_process(gateway, "/v2/logging", {"log_format": "XML"})
    assert set(refused.values()) == {(400, "invalid argument for --log_format, got: XML")}
    assert every_process_answers(gateway, "/v2/logging") == expected


# ---- trace settings -------------------------------------------------------------------


def test_trace_settings_updated_through_any_process_hold_in_every_process(gateway: Proc) -> None:
    start_global = every_process_answers(gateway, "/v2/trace/setting")
    try:
        answers = post_through_every_process(gateway, "/v2/trace/setting", {"trace_rate": "7", "trace_count": "5"})
        assert {status for status, _ in answers.values()} == {200}
        glob = every_process_answers(gateway, "/v2/trace/setting")
        assert (glob["trace_rate"], glob["trace_count"]) == ("7", "5")

        # A model's own settings, through gRPC (fresh channels), then cleared through HTTP.
        grpc_call(gateway, lambda c: c.update_trace_settings("simple", {"trace_level": ["TIMESTAMPS"],
                                                                       "trace_rate": "3"}))
        model = every_process_answers(gateway, "/v2/models/simple/trace/setting")
        assert (model["trace_level"], model["trace_rate"], model["trace_count"]) == (["TIMESTAMPS"], "3", "5")
        for _ in range(4):
            settings = grpc_call(gateway, lambda c: c.get_trace_settings("simple", as_json=True))["settings"]
            assert settings["trace_rate"] == {"value": ["3"]}
        refused = post_through_every_process(gateway, "/v2/trace/setting", {"trace_rate": "0"})
        assert {status for status, _ in refused.values()} == {400}
        assert every_process_answers(gateway, "/v2/trace/setting") == glob
        post(gateway, "/v2/models/simple/trace/setting", {"trace_level": None, "trace_rate": None})
        assert every_process_answers(gateway, "/v2/models/simple/trace/setting") == glob
    finally:
        post(gateway, "/v2/trace/setting", {"trace_rate": None, "trace_count": None})
    assert every_process_answers(gateway, "/v2/trace/setting") == start_global
