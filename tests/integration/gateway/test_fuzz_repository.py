"""Generated requests against the repository API and against models that fail
at run time, through a real gateway in front of a real ONNX Runtime worker
(hypothesis, derandomized).

Repository API (HTTP and gRPC): model names with odd characters, path parts
and NULs, over-long names; load parameters of every kind, unknown ones,
configs that are no JSON or no model config, file overrides with odd paths,
large values. Run-time failures: ``pair`` and ``encoder`` of
tests/poison_models.py with random shapes and token ids.

Asserted: never a 5xx / INTERNAL or UNKNOWN (none of these is a server
fault), every error carries a message, both processes stay up, and the
models still serve afterwards.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from urllib.parse import quote

import grpc
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tritonclient.grpc import service_pb2, service_pb2_grpc

from tests.harness import Proc, start, start_worker, worker_url
from tests.integration.gateway.test_fuzz_gateway import Http
from tests.poison_models import write_repository

pytestmark = pytest.mark.timeout(240)

FUZZ = settings(deadline=None, derandomize=True, database=None, print_blob=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
BAD_GRPC = {grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN}


@pytest.fixture(scope="module")
def procs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Proc, Proc]]:
    repo = write_repository(tmp_path_factory.mktemp("fuzz-repo"))
    config = tmp_path_factory.mktemp("fuzz-gw") / "gateway.yaml"
    config.write_text("max_request_bytes: 4194304\ndefault_timeout_s: 20\n")
    worker = start_worker(repo, "--model-control-mode", "explicit", "--load-model", "*",
                          "--execution-threads", "1", "--intra-op-threads", "1")
    gateway = None
    try:
        gateway = start(["gateway", "--worker", worker_url(worker), "--http-port", "0", "--grpc-port", "0",
                         "--config", str(config), "--log-level", "WARNING"])
        yield gateway, worker
        assert "Traceback" not in gateway.log(), gateway.log()[-4000:]
        assert "Traceback" not in worker.log(), worker.log()[-4000:]
    finally:
        if gateway is not None:
            gateway.stop()
        worker.stop()


@pytest.fixture(scope="module")
def client(procs: tuple[Proc, Proc]) -> Http:
    return Http(procs[0].ready["http_port"])


@pytest.fixture(scope="module")
def stub(procs: tuple[Proc, Proc]) -> Iterator[service_pb2_grpc.GRPCInferenceServiceStub]:
    channel = grpc.insecure_channel(f"127.0.0.1:{procs[0].ready['grpc_port']}",
                                    options=[("grpc.max_send_message_length", 64 << 20)])
    yield service_pb2_grpc.GRPCInferenceServiceStub(channel)
    channel.close()


def alive(procs: tuple[Proc, Proc]) -> None:
    assert all(p.popen.poll() is None for p in procs), "a process died"


def check_http(procs: tuple[Proc, Proc], status: int, body: bytes) -> None:
    alive(procs)
    assert status < 500, (status, body[:300])
    if status != 200:
        assert json.loads(body)["error"], body[:300]


def check_grpc(procs: tuple[Proc, Proc], call: object) -> None:
    try:
        call()  # type: ignore[operator]
    except grpc.RpcError as e:
        assert e.code() not in BAD_GRPC, (e.code(), e.details())
        assert e.details()
    alive(procs)


# ---- strategies -------------------------------------------------------------------

names = st.one_of(
    st.text(max_size=20),
    st.text(st.characters(blacklist_categories=("Cs",)), min_size=200, max_size=5000),  # over-long
    st.sampled_from(["..", ".", "../pair", "pair/../../etc", "pair\x00x", "con", "a b", "%2e%2e", "pair/1",
                     "é模型", "-", "x" * 255, "x" * 256, "x" * 4096, "pair", "encoder"]),
)
values = st.one_of(
    st.text(max_size=50), st.binary(max_size=64), st.integers(-(2**63), 2**63 - 1), st.booleans(),
    st.sampled_from(["{}", "[]", "null", '{"name": 5}', '{"max_batch_size": -1}',
                     '{"input": [{"name": "A", "data_type": "TYPE_NOPE"}]}', "{" * 5000]),
    st.builds(lambda n: "x" * n, st.sampled_from([1 << 16, 1 << 20])),  # large values
)
param_keys = st.one_of(st.sampled_from(["config", "file:1/model.onnx", "file:../../x", "file:/etc/passwd",
                                        "file:", "file:1/" + "d" * 300, "unknown"]), st.text(max_size=12))


def grpc_param(value: object) -> service_pb2.ModelRepositoryParameter:
    if isinstance(value, bool):
        return service_pb2.ModelRepositoryParameter(bool_param=value)
    if isinstance(value, int):
        return service_pb2.ModelRepositoryParameter(int64_param=value)
    if isinstance(value, bytes):
        return service_pb2.ModelRepositoryParameter(bytes_param=value)
    return service_pb2.ModelRepositoryParameter(string_param=str(value))


# ---- repository API ------------------------------------------------------------------


@settings(FUZZ, max_examples=60)
@given(name=names, params=st.dictionaries(param_keys, values, max_size=3), unload=st.booleans())
def test_http_repository_calls(procs: tuple[Proc, Proc], client: Http, name: str, params: dict[str, object],
                               unload: bool) -> None:
    path = f"/v2/repository/models/{quote(name, safe='')}/{'unload' if unload else 'load'}"
    body = {"parameters": {k: (v.hex() if isinstance(v, bytes) else v) for k, v in params.items()}}
    status, raw = client.post(path, json.dumps(body).encode(), {"Content-Type": "application/json"})
    check_http(procs, status, raw)


@settings(FUZZ, max_examples=60)
@given(name=names, params=st.dictionaries(param_keys, values, max_size=3), unload=st.booleans())
def test_grpc_repository_calls(procs: tuple[Proc, Proc], stub: service_pb2_grpc.GRPCInferenceServiceStub,
                               name: str, params: dict[str, object], unload: bool) -> None:
    if unload:
        request = service_pb2.RepositoryModelUnloadRequest(model_name=name)
        call = stub.RepositoryModelUnload
    else:
        request = service_pb2.RepositoryModelLoadRequest(model_name=name)
        call = stub.RepositoryModelLoad
    for key, value in params.items():
        request.parameters[key].CopyFrom(grpc_param(value))
    check_grpc(procs, lambda: call(request, timeout=30))
    check_grpc(procs, lambda: stub.RepositoryIndex(service_pb2.RepositoryIndexRequest(), timeout=30))


# ---- models that fail at run time -------------------------------------------------------


@settings(FUZZ, max_examples=80)
@given(a=st.tuples(st.integers(0, 5), st.integers(3, 5)), b=st.tuples(st.integers(0, 5), st.integers(3, 5)),
       ids=st.lists(st.lists(st.integers(-40, 40), min_size=1, max_size=12), min_size=1, max_size=3))
def test_run_time_failures_are_the_requests(procs: tuple[Proc, Proc], client: Http,
                                           a: tuple[int, int], b: tuple[int, int], ids: list[list[int]]) -> None:
    pair = {"inputs": [
        {"name": "A", "datatype": "FP32", "shape": list(a), "data": [1.0] * (a[0] * a[1])},
        {"name": "B", "datatype": "FP32", "shape": list(b), "data": [1.0] * (b[0] * b[1])},
    ]}
    status, raw = client.post("/v2/models/pair/infer", json.dumps(pair).encode(), {})
    check_http(procs, status, raw)
    width = len(ids[0])
    rows = [(row * width)[:width] for row in ids]  # a rectangle
    encoder = {"inputs": [{"name": "TOKENS", "datatype": "INT64", "shape": [len(rows), width],
                           "data": np.array(rows).ravel().tolist()}]}
    status, raw = client.post("/v2/models/encoder/infer", json.dumps(encoder).encode(), {})
    check_http(procs, status, raw)


def test_the_models_still_serve(procs: tuple[Proc, Proc], client: Http) -> None:
    status, raw = client.post("/v2/repository/models/encoder/load", b"", {})  # the fuzzer may have unloaded it
    assert status == 200, raw[:300]
    body = {"inputs": [{"name": "TOKENS", "datatype": "INT64", "shape": [1, 3], "data": [1, 2, 3]}]}
    status, raw = client.post("/v2/models/encoder/infer", json.dumps(body).encode(), {})
    assert status == 200, raw[:300]
    alive(procs)
