"""A generation survives its worker, with real processes: two ``infergate
worker`` processes serving ``tiny_lm`` behind a gateway, concurrent greedy
streams (``ignore_eos``) over one gRPC stream, and the worker holding some of
them SIGKILLed mid-run.

Checked: every stream completes with no error; its text is, byte for byte,
the text an uninterrupted run of the same request sent through the same
gateway (so no response missing, none twice); its final response counts the
whole generation (the prompt's tokens, every completion token); the killed
worker had streams open, unfinished, when it died (both workers are frozen
with SIGSTOP once every stream is under way, the one holding more streams is
SIGKILLed, the other goes on), each of them resumed on the other worker, and
the gateway counts the resumes.
"""

from __future__ import annotations

import shutil
import signal
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.harness import Proc, start, start_together, start_worker, worker_url
from tests.integration.gateway.stream_clients import metric, poll
from tests.integration.workers.gen_client import Generation, GenStream

pytestmark = pytest.mark.timeout(180)

PROMPTS = ["Once upon a time", "The quick brown fox", "été", "Hello, world", "In the beginning",
           "A B C", "lorem ipsum dolor", "0123456789", "zebra", "Why?", "sky", "tiny lm"]


@dataclass
class Cluster:
    workers: list[Proc]
    gateway: Proc

    @property
    def grpc_url(self) -> str:
        return f"127.0.0.1:{self.gateway.ready['grpc_port']}"

    @property
    def http_url(self) -> str:
        return f"127.0.0.1:{self.gateway.ready['http_port']}"

    def inflight(self, worker: Proc) -> float:
        return metric(self.http_url, "infergate_worker_inflight_batches", f'worker="{worker_url(worker)}"')


@pytest.fixture
def cluster(model_repo: Path, tmp_path: Path) -> Iterator[Cluster]:
    repo = tmp_path / "models"
    shutil.copytree(model_repo / "tiny_lm", repo / "tiny_lm")
    workers = start_together([lambda: start_worker(repo), lambda: start_worker(repo)])
    try:
        config = tmp_path / "gateway.yaml"
        config.write_text("probe:\n  interval_s: 0.5\n")
        args = ["gateway", "--http-port", "0", "--grpc-port", "0", "--config", str(config)]
        for w in workers:
            args += ["--worker", worker_url(w)]
        gateway = start(args)
        try:
            found = Cluster(workers, gateway)
            poll(lambda: metric(found.http_url, "infergate_model_replicas", 'model="tiny_lm"') == 2,
                 "both workers serving tiny_lm through the gateway")
            yield found
        finally:
            gateway.stop()
    finally:
        for w in workers:
            w.stop(check=False)


class WatchedStream(GenStream):
    """A GenStream whose reader can wait for a condition on its generations, woken by each response."""

    def __init__(self, url: str) -> None:
        self.changed = threading.Condition()
        super().__init__(url)

    def _callback(self, result: object, error: object) -> None:
        super()._callback(result, error)  # type: ignore[arg-type]
        with self.changed:
            self.changed.notify_all()

    def wait_until(self, condition: Callable[[], bool], what: str, timeout_s: float = 60.0) -> None:
        with self.changed:
            assert self.changed.wait_for(condition, timeout_s), f"{what}: not within {timeout_s} s"


def run_all(url: str, tag: str, count: int, max_tokens: int) -> tuple[WatchedStream, list[Generation]]:
    stream = WatchedStream(url)
    generations = [stream.send("tiny_lm", f"{tag}-{i}", PROMPTS[i % len(PROMPTS)], max_tokens=max_tokens,
                               temperature=0.0, parameters={"ignore_eos": True}) for i in range(count)]
    return stream, generations


def wait_done(generations: list[Generation], timeout_s: float = 120.0) -> None:
    for g in generations:
        assert g.done.wait(timeout_s), f"a stream unfinished after {timeout_s}s: {len(g.tokens)} tokens"


def check_survives(cluster: Cluster, count: int, max_tokens: int) -> None:
    stream, expected = run_all(cluster.grpc_url, "whole", count, max_tokens)
    try:
        wait_done(expected)
    finally:
        stream.close()
    assert all(g.error is None and g.completion_tokens == max_tokens for g in expected), \
        [(g.error, g.completion_tokens) for g in expected]

    resumed_before = metric(cluster.http_url, "infergate_stream_resumes_total", 'model="tiny_lm"')
    stream, generations = run_all(cluster.grpc_url, "cut", count, max_tokens)
    try:
        # As soon as every stream has begun, both workers are frozen where they are (the worker runs
        # ahead of what the client has read, so the earlier the surer its streams are unfinished).
        stream.wait_until(lambda: all(g.tokens for g in generations), "every stream under way")
        frozen = list(cluster.workers)
        for w in frozen:
            w.kill(signal.SIGSTOP)
        killed = None
        try:
            assert not any(g.done.is_set() for g in generations)
            victim = max(cluster.workers, key=cluster.inflight)
            open_on_victim = cluster.inflight(victim)
            assert open_on_victim >= 1
            victim.kill()
            killed = victim
        finally:
            for w in frozen:
                if w is not killed:
                    w.kill(signal.SIGCONT)
        wait_done(generations)
    finally:
        stream.close()
    for i, (want, got) in enumerate(zip(expected, generations)):
        assert got.error is None, (i, got.error)
        assert got.text == want.text, (i, len(got.text), len(want.text))
        assert (got.finish_reason, got.prompt_tokens, got.completion_tokens) == \
            (want.finish_reason, want.prompt_tokens, max_tokens), i
    resumed = metric(cluster.http_url, "infergate_stream_resumes_total", 'model="tiny_lm"') - resumed_before
    assert resumed == open_on_victim, (resumed, open_on_victim)


def test_greedy_streams_whose_worker_is_killed_go_on_on_the_other_unchanged(cluster: Cluster) -> None:
    check_survives(cluster, count=8, max_tokens=480)


@pytest.mark.slow
def test_sixteen_long_streams_survive_their_worker(cluster: Cluster) -> None:
    check_survives(cluster, count=16, max_tokens=480)
