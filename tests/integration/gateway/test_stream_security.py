"""Streams of a decoupled model under API keys, with real processes: a worker
serving ``square_int32`` and ``simple``, a gateway requiring keys in front.

Checked: a stream without a valid key is refused as a whole (UNAUTHENTICATED);
with a key that may use the model it is served; a key limited to another
model ends the stream with PERMISSION_DENIED; a key's rate limit counts each
streamed request, not each response.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from tests.harness import Proc, start, start_worker, worker_url
from tests.integration.gateway.stream_clients import Stream, poll, square_inputs

pytestmark = pytest.mark.timeout(120)

FULL = "stream-full-key-0123456789"
NARROW = "stream-narrow-key-0123456789"
LIMITED = "stream-limited-key-0123456789"


def bearer(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


@pytest.fixture(scope="module")
def gateway(model_repo: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proc]:
    root = tmp_path_factory.mktemp("stream-keys")
    for name in ("square_int32", "simple"):
        shutil.copytree(model_repo / name, root / "models" / name)
    keys = root / "api-keys"
    keys.write_text(f"{FULL} name=full\n{NARROW} simple name=narrow\n{LIMITED} * rate=2/h name=limited\n")
    worker = start_worker(root / "models")
    try:
        proc = start(["gateway", "--worker", worker_url(worker), "--http-port", "0", "--grpc-port", "0",
                      "--api-key-file", str(keys)])
        try:
            client = grpcclient.InferenceServerClient(f"127.0.0.1:{proc.ready['grpc_port']}")
            poll(lambda: client.is_model_ready("square_int32", headers=bearer(FULL)), "the model ready")
            client.close()
            yield proc
        finally:
            proc.stop()
    finally:
        worker.stop()


def url(proc: Proc) -> str:
    return f"127.0.0.1:{proc.ready['grpc_port']}"


def send_quietly(stream: Stream, request_id: str, n: int) -> None:
    try:
        stream.send("square_int32", square_inputs(n), request_id, empty_final=True)
    except InferenceServerException:
        pass  # the server ended the stream before this send; its status reaches the callback


def test_a_stream_without_a_valid_key_is_refused(gateway: Proc) -> None:
    for headers in (None, bearer("wrong-key-0123456789")):
        stream = Stream(url(gateway), headers=headers)
        send_quietly(stream, "r", 2)
        got = stream.wait_for(lambda got: any(r.error for r in got))
        stream.finish()
        assert [r.values for r in got if r.error is None] == []
        assert "UNAUTHENTICATED" in got[-1].error and "missing or invalid API key" in got[-1].error


def test_a_stream_with_a_key_for_the_model_is_served(gateway: Proc) -> None:
    stream = Stream(url(gateway), headers=bearer(FULL))
    stream.send("square_int32", square_inputs(3), "r", empty_final=True)
    got = stream.finish()
    assert [r.values for r in got] == [[3], [3], [3], None] and got[-1].final is True


def test_a_key_for_another_model_ends_the_stream(gateway: Proc) -> None:
    stream = Stream(url(gateway), headers=bearer(NARROW))
    send_quietly(stream, "r", 2)
    got = stream.wait_for(lambda got: any(r.error for r in got))
    stream.finish()
    assert "PERMISSION_DENIED" in next(r.error for r in got if r.error)
    assert all(r.values is None for r in got)


def test_a_rate_limit_counts_streamed_requests(gateway: Proc) -> None:
    stream = Stream(url(gateway), headers=bearer(LIMITED))
    stream.send("square_int32", square_inputs(4), "one", empty_final=True)
    stream.wait_for(lambda got: any(r.final for r in got))  # four responses, one request of the quota
    stream.send("square_int32", square_inputs(1), "two", empty_final=True)
    stream.wait_for(lambda got: sum(1 for r in got if r.final) == 2)
    send_quietly(stream, "three", 1)
    got = stream.wait_for(lambda got: any(r.error for r in got))
    stream.finish()
    assert "RESOURCE_EXHAUSTED" in next(r.error for r in got if r.error)
    assert [r.values for r in stream.of("one")] == [[4]] * 4 + [None]
    assert stream.of("three") == []
