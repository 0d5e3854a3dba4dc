"""The example decoupled models' files (``models/python_models.py`` writes
them) in a real Triton Inference Server (tests/triton_harness.py): the same
``square_int32`` and ``repeat_int32`` answers as from ``infergate worker``,
which proves the files are in Triton's format and our worker's semantics are
Triton's (final flags, the empty final response, the unary refusal).
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from models.python_models import PYTHON_MODEL_NAMES, build_python_models
from tests.integration.workers.decoupled_client import (
    Stream,
    assert_square_answer,
    by_request,
    infer_inputs,
    repeat,
    square,
)
from tests.triton_harness import TritonProc, start_triton, triton_available

AVAILABLE, REASON = triton_available()

pytestmark = [
    pytest.mark.triton,
    pytest.mark.timeout(180),
    pytest.mark.skipif(not AVAILABLE, reason=f"no real Triton here: {REASON}"),
]


@pytest.fixture(scope="module")
def triton(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TritonProc]:
    repo = tmp_path_factory.mktemp("decoupled-models")
    assert build_python_models(repo) == list(PYTHON_MODEL_NAMES)
    proc = start_triton(repo, models=list(PYTHON_MODEL_NAMES), workdir=tmp_path_factory.mktemp("triton-run"))
    try:
        yield proc
    finally:
        proc.stop()  # asserts exit status 0


@pytest.fixture
def client(triton: TritonProc) -> Iterator[grpcclient.InferenceServerClient]:
    client = grpcclient.InferenceServerClient(triton.grpc_url)
    yield client
    client.close()


@pytest.mark.parametrize("n", [0, 1, 5, 37])
@pytest.mark.parametrize("empty_final", [True, False])
def test_square_answers_as_on_the_worker(client: grpcclient.InferenceServerClient, n: int, empty_final: bool) -> None:
    stream = Stream(client)
    stream.send("square_int32", square(n), f"sq-{n}", empty_final=empty_final)
    assert_square_answer(stream.close(), f"sq-{n}", n, empty_final)


def test_repeat_and_interleaving_as_on_the_worker(client: grpcclient.InferenceServerClient) -> None:
    stream = Stream(client)
    stream.send("repeat_int32", repeat([4, -2, 7], delay_ms=2), "a")
    stream.send("square_int32", square(2), "b")
    grouped = by_request(stream.close())
    assert [r.outputs["OUT"].tolist()[0] for r in grouped["a"] if r.outputs] == [4, -2, 7]
    assert [r.outputs["IDX"].tolist()[0] for r in grouped["a"] if r.outputs] == [0, 1, 2]
    assert [r.final for r in grouped["a"]] == [False, False, False, True]
    assert_square_answer(grouped["b"], "b", 2, True)


def test_errors_as_on_the_worker(client: grpcclient.InferenceServerClient) -> None:
    stream = Stream(client)
    stream.send("square_int32", square(-3), "negative")
    assert stream.next().error == "IN must be >= 0, got -3"
    stream.send("repeat_int32", {**repeat([1, 2]), "DELAY": np.array([1], dtype=np.uint32)}, "raises")
    error = stream.next().error
    # Triton adds the model's traceback (with its file's path); the worker leaves it out.
    assert error is not None and error.startswith("TritonModelException: DELAY must have as many elements as IN (2), got 1")
    stream.send("square_int32", square(1), "after")
    assert len(stream.until_final("after")) == 2
    stream.close()


def test_config_and_unary_refusal(client: grpcclient.InferenceServerClient) -> None:
    assert client.get_model_config("square_int32").config.model_transaction_policy.decoupled
    assert client.get_model_metadata("square_int32").platform == "python"
    with pytest.raises(InferenceServerException) as err:
        client.infer("square_int32", infer_inputs(square(2)))
    assert err.value.status() == "StatusCode.UNIMPLEMENTED"
    assert err.value.message() == "ModelInfer RPC doesn't support models with decoupled transaction policy"
