"""Streams through the gateway when workers go away, with real processes: two
``infergate worker`` processes serving ``repeat_int32`` and a gateway in front.

Checked: draining a worker waits for the stream open on it, which completes;
a gateway told to stop lets its open stream finish, then exits;
a worker killed mid-stream ends the request it served with an in-stream error
naming the worker and the responses already sent (``StreamLost``, UNAVAILABLE
where a code is sent), while a stream on the other worker completes.
"""

from __future__ import annotations

import json
import shutil
import signal
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import tritonclient.grpc as grpcclient

from tests.harness import Proc, start, start_worker, worker_url
from tests.integration.gateway.stream_clients import GatewayCluster, Stream, metric, poll, repeat_inputs

pytestmark = pytest.mark.timeout(120)


class Cluster(GatewayCluster):
    def serving(self, model: str) -> int:
        with urllib.request.urlopen(f"http://{self.http_url}/metrics", timeout=10) as response:
            text = response.read().decode()
        line = next((l for l in text.splitlines() if l.startswith(f'infergate_model_replicas{{model="{model}"}}')), "")
        return int(float(line.split()[-1])) if line else 0


@pytest.fixture(scope="module")
def cluster(model_repo: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    repo = tmp_path_factory.mktemp("stream-models")
    shutil.copytree(model_repo / "repeat_int32", repo / "repeat_int32")
    workers = [start_worker(repo), start_worker(repo)]
    try:
        config = tmp_path_factory.mktemp("gateway") / "gateway.yaml"
        config.write_text("probe:\n  interval_s: 0.5\n")
        args = ["gateway", "--http-port", "0", "--grpc-port", "0", "--config", str(config)]
        for w in workers:
            args += ["--worker", worker_url(w)]
        gateway = start(args)
        try:
            found = Cluster(workers, gateway)
            poll(lambda: found.serving("repeat_int32") == 2, "both workers serving through the gateway")
            yield found
        finally:
            gateway.stop()
    finally:
        for w in workers:
            w.stop(check=False)


def holder(cluster: Cluster) -> Proc:
    """The worker the gateway counts one stream in flight on (the only one with any)."""
    poll(lambda: sum(cluster.inflight(w) for w in cluster.workers) == 1, "one stream in flight")
    return next(w for w in cluster.workers if cluster.inflight(w) == 1)


def test_draining_a_worker_waits_for_its_open_stream(cluster: Cluster) -> None:
    label = 'model="repeat_int32"'
    before = metric(cluster.http_url, "infergate_stream_responses_total", label)
    stream = Stream(cluster.grpc_url)
    stream.send("repeat_int32", repeat_inputs(list(range(20)), delay_ms=50), "drained", empty_final=True)
    stream.wait_for(lambda got: len(got) >= 1)
    worker = holder(cluster)
    address = worker_url(worker)
    request = urllib.request.Request(f"http://{cluster.http_url}/v2/cluster/workers/{address}/drain?timeout_s=30",
                                     method="POST")
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            answer = json.loads(response.read())
        assert answer["state"] == "drained" and answer["inflight"] == 0, answer
        # The drain answered once the stream had ended: every response had gone out.
        assert metric(cluster.http_url, "infergate_stream_responses_total", label) == before + 21
        got = stream.finish()
        assert [r.values[0] for r in got[:-1]] == list(range(20)) and got[-1].final is True
        assert all(r.error is None for r in got)
    finally:
        undrain = urllib.request.Request(f"http://{cluster.http_url}/v2/cluster/workers/{address}/undrain",
                                         method="POST")
        urllib.request.urlopen(undrain, timeout=30).close()
        poll(lambda: cluster.serving("repeat_int32") == 2, "the worker back in rotation")


def test_a_gateway_shutting_down_lets_its_open_stream_finish(cluster: Cluster) -> None:
    gateway = start(["gateway", "--http-port", "0", "--grpc-port", "0",
                     *[a for w in cluster.workers for a in ("--worker", worker_url(w))]])
    try:
        url = f"127.0.0.1:{gateway.ready['grpc_port']}"
        client = grpcclient.InferenceServerClient(url)
        poll(lambda: client.is_model_ready("repeat_int32"), "the model ready")
        client.close()
        stream = Stream(url)
        stream.send("repeat_int32", repeat_inputs(list(range(20)), delay_ms=50), "last", empty_final=True)
        stream.wait_for(lambda got: len(got) >= 1)
        gateway.popen.send_signal(signal.SIGTERM)  # within the grace period (30 s by default)
        got = stream.wait_for(lambda got: any(r.final or r.error for r in got))
        assert all(r.error is None for r in got), got
        assert [r.values[0] for r in got[:-1]] == list(range(20)) and got[-1].final is True
        stream.finish()
        assert gateway.popen.wait(timeout=30) == 0
    finally:
        gateway.stop(check=False)


def test_a_worker_killed_mid_stream_ends_its_stream_and_the_other_completes(cluster: Cluster) -> None:
    values = list(range(80))  # the survivor's: four seconds
    first = Stream(cluster.grpc_url)  # the victim's: ten seconds, cut short
    first.send("repeat_int32", repeat_inputs(list(range(400)), delay_ms=25), "first", empty_final=True)
    first.wait_for(lambda got: len(got) >= 2)
    victim = holder(cluster)
    survivor = next(w for w in cluster.workers if w is not victim)
    second = Stream(cluster.grpc_url)  # the least loaded replica: the other worker
    second.send("repeat_int32", repeat_inputs(values, delay_ms=50), "second", empty_final=True)
    second.wait_for(lambda got: len(got) >= 2)
    poll(lambda: cluster.inflight(survivor) == 1, "the second stream on the other worker")
    victim.kill()
    first.wait_for(lambda got: any(r.error for r in got))
    error = next(r.error for r in first.got if r.error)
    assert f"worker {worker_url(victim)}" in error and "response(s) were sent" in error, error
    # An in-stream error carries words only (Triton's wire has no code there); the stream goes on.
    sent = [r for r in first.got if r.error is None]
    assert 2 <= len(sent) < 400 and f"after {len(sent)} response(s)" in error
    got = second.finish()
    assert all(r.error is None for r in got), got
    assert [r.values[0] for r in got[:-1]] == values and got[-1].final is True
    first.finish()
    client = grpcclient.InferenceServerClient(cluster.grpc_url)
    try:
        assert client.is_model_ready("repeat_int32")  # still served, by the survivor
    finally:
        client.close()
