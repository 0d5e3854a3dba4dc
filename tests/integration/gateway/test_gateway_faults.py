"""The gateway under failure, end to end through ``infergate up``: a bounded
queue that sheds load at once, a worker killed mid-stream (no request fails;
the worker comes back on its port and into rotation), and SIGTERM stopping
the whole local cluster.

One cluster serves the module. Its config makes ``cnn``'s queue tiny and
slow to drain (Triton-style fixed delay), so overflow is deterministic; the
other models keep the defaults. The SIGTERM test stops the cluster, so it
runs last.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.grpc.aio as grpcclient_aio
import tritonclient.http as httpclient
import tritonclient.http.aio as httpclient_aio
from tritonclient.utils import InferenceServerException

from tests.harness import Proc, start

pytestmark = pytest.mark.timeout(180)

QUEUE_SIZE = 4
# Long enough that a request shed at the door is answered well before any
# queued one (those wait out the delay); short enough to keep the test quick.
QUEUE_DELAY_US = 1_500_000
RECOVERY_TIMEOUT_S = 90.0


@pytest.fixture(scope="module")
def cluster(model_repo: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proc]:
    config = tmp_path_factory.mktemp("gateway-faults") / "gateway.yaml"
    config.write_text(
        "models:\n"
        f"  cnn: {{max_queue_size: {QUEUE_SIZE}, mode: fixed, max_queue_delay_us: {QUEUE_DELAY_US}}}\n"
    )
    proc = start(["up", "--workers", "2", "--model-repository", str(model_repo),
                  "--http-port", "0", "--grpc-port", "0", "--config", str(config)])
    try:
        yield proc
    finally:
        proc.stop()


def _session(model_repo: Path, model: str) -> ort.InferenceSession:
    return ort.InferenceSession(str(model_repo / model / "1" / "model.onnx"), providers=["CPUExecutionProvider"])


@pytest.fixture(scope="module")
def cnn_reference(model_repo: Path) -> Callable[[np.ndarray], np.ndarray]:
    session = _session(model_repo, "cnn")
    return lambda x: session.run(["PROBS"], {"IMAGE": x})[0]


@pytest.fixture(scope="module")
def mlp_reference(model_repo: Path) -> Callable[[np.ndarray], np.ndarray]:
    session = _session(model_repo, "mlp")
    return lambda x: session.run(["OUTPUT"], {"INPUT": x})[0]


def children(pid: int) -> set[int]:
    """Direct child processes of ``pid`` (Linux /proc)."""
    found: set[int] = set()
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            found.update(int(c) for c in (task / "children").read_text().split())
        except OSError:
            continue
    return found


def is_gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True
    return state in ("Z", "X")  # a zombie has exited; only its parent's bookkeeping is left


def worker_headers(proc: Proc) -> dict[str, str]:
    """gRPC metadata that lets a test call the cluster's workers directly (their shared token)."""
    token_file = proc.ready.get("worker_token_file")
    if not token_file:
        return {}
    return {"authorization": f"Bearer {Path(token_file).read_text().strip()}"}


async def worker_inference_count(proc: Proc, address: str, model: str) -> int | None:
    """The worker's own count for ``model``, or None while it does not answer."""
    client = grpcclient_aio.InferenceServerClient(address)
    try:
        stats = await client.get_inference_statistics(model, headers=worker_headers(proc), client_timeout=2.0)
        return stats.model_stats[0].inference_count
    except InferenceServerException:
        return None
    finally:
        await client.close()


# ---- bounded queue -------------------------------------------------------------


Outcome = tuple[float, "np.ndarray | InferenceServerException"]  # (completion time, output or error)


async def _flood(send: Callable[[int], Awaitable[np.ndarray]], n: int) -> list[Outcome]:
    """Fire ``n`` requests at once."""

    async def one(i: int) -> Outcome:
        try:
            out: np.ndarray | InferenceServerException = await send(i)
        except InferenceServerException as e:
            out = e
        return time.monotonic(), out

    return await asyncio.gather(*(one(i) for i in range(n)))


@pytest.mark.parametrize("protocol", ["http", "grpc"])
async def test_full_queue_rejects_at_once(cluster: Proc, cnn_reference: Callable, protocol: str) -> None:
    n = 16
    x = np.random.default_rng(7).standard_normal((n, 3, 32, 32), dtype=np.float32)
    want = cnn_reference(x)
    if protocol == "http":
        client = httpclient_aio.InferenceServerClient(f"127.0.0.1:{cluster.ready['http_port']}", conn_limit=n)

        async def send(i: int) -> np.ndarray:
            tensor = httpclient.InferInput("IMAGE", [1, 3, 32, 32], "FP32")
            tensor.set_data_from_numpy(x[i:i + 1])
            return (await client.infer("cnn", [tensor])).as_numpy("PROBS")

        rejected_status = "503"
    else:
        client = grpcclient_aio.InferenceServerClient(f"127.0.0.1:{cluster.ready['grpc_port']}")

        async def send(i: int) -> np.ndarray:
            tensor = grpcclient.InferInput("IMAGE", [1, 3, 32, 32], "FP32")
            tensor.set_data_from_numpy(x[i:i + 1])
            return (await client.infer("cnn", [tensor])).as_numpy("PROBS")

        rejected_status = "StatusCode.UNAVAILABLE"
    try:
        results = await _flood(send, n)
    finally:
        await client.close()

    ok = [(t, i) for i, (t, out) in enumerate(results) if isinstance(out, np.ndarray)]
    rejected = [(t, out) for t, out in results if isinstance(out, InferenceServerException)]
    assert ok and rejected, f"{len(ok)} succeeded, {len(rejected)} rejected"
    assert len(ok) + len(rejected) == n
    # At most a queue's worth is held at a time; everything else is shed.
    assert len(ok) <= 2 * QUEUE_SIZE
    for _, error in rejected:
        assert error.status() == rejected_status, (error.status(), error.message())
        assert "queue" in error.message().lower()
    for _, i in ok:
        np.testing.assert_allclose(results[i][1], want[i:i + 1], rtol=1e-5, atol=1e-5)
    # Rejected at the door: every rejection is answered before the first
    # queued request comes back (those wait out the batching delay).
    assert max(t for t, _ in rejected) < min(t for t, _ in ok)

    # The gateway is unharmed: a request after the flood succeeds.
    probe = grpcclient.InferenceServerClient(f"127.0.0.1:{cluster.ready['grpc_port']}")
    try:
        tensor = grpcclient.InferInput("IMAGE", [1, 3, 32, 32], "FP32")
        tensor.set_data_from_numpy(x[:1])
        np.testing.assert_allclose(probe.infer("cnn", [tensor]).as_numpy("PROBS"), want[:1], rtol=1e-5, atol=1e-5)
    finally:
        probe.close()


# ---- a worker dies mid-stream --------------------------------------------------


async def test_killed_worker_is_restarted_and_rejoins(cluster: Proc, mlp_reference: Callable) -> None:
    x = np.random.default_rng(8).standard_normal((4, 64), dtype=np.float32)
    want = mlp_reference(x)
    victim = cluster.ready["workers"][0]
    gateway_pid = cluster.ready["gateway_pid"]
    assert victim["pid"] in children(gateway_pid)

    grpc_client = grpcclient_aio.InferenceServerClient(f"127.0.0.1:{cluster.ready['grpc_port']}")
    http_client = httpclient_aio.InferenceServerClient(f"127.0.0.1:{cluster.ready['http_port']}")
    done = 0
    failures: list[str] = []
    stop = asyncio.Event()

    async def stream(use_http: bool) -> None:
        nonlocal done
        while not stop.is_set():
            try:
                if use_http:
                    tensor = httpclient.InferInput("INPUT", [4, 64], "FP32")
                    tensor.set_data_from_numpy(x)
                    out = (await http_client.infer("mlp", [tensor])).as_numpy("OUTPUT")
                else:
                    tensor = grpcclient.InferInput("INPUT", [4, 64], "FP32")
                    tensor.set_data_from_numpy(x)
                    out = (await grpc_client.infer("mlp", [tensor])).as_numpy("OUTPUT")
                np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5)
                done += 1
            except (InferenceServerException, AssertionError) as e:
                failures.append(f"{type(e).__name__}: {e}")

    async def wait_for(condition: Callable[[], Awaitable[bool]], what: str) -> None:
        deadline = time.monotonic() + RECOVERY_TIMEOUT_S
        while not await condition():
            assert time.monotonic() < deadline, f"timed out waiting for {what}"
            assert not failures, failures[:3]
            # Polling a condition on a live system, not a sleep standing in for readiness.
            await asyncio.sleep(0.1)

    streams = [asyncio.create_task(stream(use_http=i % 2 == 1)) for i in range(6)]
    try:
        async def some_done() -> bool:
            return done >= 50

        await wait_for(some_done, "requests before the kill")
        os.kill(victim["pid"], signal.SIGKILL)
        killed_at = done

        async def replaced() -> bool:
            new = children(gateway_pid) - {w["pid"] for w in cluster.ready["workers"]}
            count = await worker_inference_count(cluster, victim["address"], "mlp") if new else None
            return bool(new) and count is not None and count > 0

        # A new process on the same port, serving requests the gateway routed to it.
        await wait_for(replaced, "the restarted worker to receive requests")
        restarted_count = await worker_inference_count(cluster, victim["address"], "mlp")
        assert restarted_count is not None and restarted_count > 0
        assert is_gone(victim["pid"])
    finally:
        stop.set()
        await asyncio.gather(*streams)
        await grpc_client.close()
        await http_client.close()
    assert not failures, f"{len(failures)} requests failed, e.g. {failures[:3]}"
    assert done > killed_at


# ---- shutdown ------------------------------------------------------------------


def test_sigterm_stops_gateway_and_workers(cluster: Proc) -> None:
    """Runs last in this module: it stops the module's cluster."""
    workers = children(cluster.ready["gateway_pid"])
    assert len(workers) == 2
    assert {w["pid"] for w in cluster.ready["workers"]} & workers  # the one never killed, at least
    cluster.stop()  # SIGTERM; asserts exit status 0
    deadline = time.monotonic() + 30
    while not all(is_gone(pid) for pid in workers):
        assert time.monotonic() < deadline, f"workers still running: {[p for p in workers if not is_gone(p)]}"
        time.sleep(0.05)
