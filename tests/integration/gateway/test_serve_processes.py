"""``infergate serve --processes 2``: each gateway process runs its own copy
of the repository's models behind the shared ports. Checked over plain HTTP
connections (the kernel spreads them over the processes, and each answer
names its process): both processes answer, each equal to ONNX Runtime on
the same file; an unload through one process takes the model away in
every process, a load brings it back in every process; the statistics are
the whole gateway's.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
import requests

from tests.harness import Proc, start
from tests.integration.gateway.stream_clients import poll

pytestmark = pytest.mark.timeout(180)

PROCESS_HEADER = "X-Infergate-Process"
TRIES = 60  # new connections per check: the chance that all land on one of two processes is 2^-59


@pytest.fixture(scope="module")
def served(model_repo: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Proc, Path]]:
    repo = tmp_path_factory.mktemp("serve-processes")
    for name in ("simple", "mlp"):
        shutil.copytree(model_repo / name, repo / name)
    proc = start(["serve", "--model-repository", str(repo), "--processes", "2", "--http-port", "0", "--grpc-port", "0"])
    try:
        yield proc, repo
    finally:
        proc.stop()


def _base(proc: Proc) -> str:
    return f"http://127.0.0.1:{proc.ready['http_port']}"


def _mlp_request(rows: int, seed: int) -> tuple[dict[str, object], np.ndarray]:
    x = np.random.default_rng(seed).standard_normal((rows, 64)).astype(np.float32)
    body = {"inputs": [{"name": "INPUT", "shape": list(x.shape), "datatype": "FP32", "data": x.ravel().tolist()}]}
    return body, x


def _each_process(proc: Proc, check: Callable[[requests.Response], None]) -> set[str]:
    """``check`` on answers over new connections until both processes have answered; the processes seen."""
    seen: set[str] = set()
    for i in range(TRIES):
        body, _ = _mlp_request(1, i)
        with requests.Session() as session:  # a new connection each time
            answer = session.post(f"{_base(proc)}/v2/models/mlp/infer", json=body, timeout=30)
        check(answer)
        seen.add(answer.headers[PROCESS_HEADER])
        if seen == {"0", "1"}:
            break
    return seen


def test_both_processes_answer_what_onnx_runtime_computes(served: tuple[Proc, Path]) -> None:
    proc, repo = served
    session = ort.InferenceSession(str(repo / "mlp" / "1" / "model.onnx"), providers=["CPUExecutionProvider"])
    (output,) = [o.name for o in session.get_outputs()]
    (name,) = [i.name for i in session.get_inputs()]
    assert name == "INPUT"
    seen: set[str] = set()
    for i in range(TRIES):
        body, x = _mlp_request(3, 100 + i)
        with requests.Session() as client:
            answer = client.post(f"{_base(proc)}/v2/models/mlp/infer", json=body, timeout=30)
        assert answer.status_code == 200, answer.text
        got = answer.json()["outputs"][0]
        assert got["name"] == output
        np.testing.assert_allclose(np.array(got["data"], dtype=np.float32).reshape(got["shape"]),
                                   session.run(None, {name: x})[0], rtol=1e-5, atol=1e-6)
        seen.add(answer.headers[PROCESS_HEADER])
        if seen == {"0", "1"}:
            break
    assert seen == {"0", "1"}


def test_unload_and_load_reach_every_process(served: tuple[Proc, Path]) -> None:
    proc, _ = served
    base = _base(proc)
    assert requests.post(f"{base}/v2/repository/models/mlp/unload", timeout=60).status_code == 200

    def refused(answer: requests.Response) -> None:
        assert answer.status_code in (400, 404) and "mlp" in answer.json()["error"], answer.text

    assert _each_process(proc, refused) == {"0", "1"}
    assert requests.post(f"{base}/v2/repository/models/mlp/load", timeout=120).status_code == 200

    def answered(answer: requests.Response) -> None:
        assert answer.status_code == 200, answer.text

    assert _each_process(proc, answered) == {"0", "1"}


def test_statistics_are_the_whole_gateways(served: tuple[Proc, Path]) -> None:
    proc, _ = served
    base = _base(proc)

    def count() -> int:
        stats = requests.get(f"{base}/v2/models/simple/stats", timeout=30).json()["model_stats"]
        return sum(s["inference_count"] for s in stats)

    before = count()
    body = {"inputs": [{"name": n, "shape": [1, 16], "datatype": "INT32", "data": list(range(16))}
                       for n in ("INPUT0", "INPUT1")]}
    seen = set()
    for _ in range(TRIES):
        with requests.Session() as client:
            answer = client.post(f"{base}/v2/models/simple/infer", json=body, timeout=30)
        assert answer.status_code == 200
        seen.add(answer.headers[PROCESS_HEADER])
    assert seen == {"0", "1"}
    poll(lambda: count() == before + TRIES, "every process's requests counted once")
