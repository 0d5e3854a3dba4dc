"""A generation survives its worker, with real processes: two ``infergate
worker`` processes serving a byte-level decoder built as ``tiny_lm`` is,
wider, behind a gateway, concurrent greedy
streams (``ignore_eos``) over one gRPC stream, and the worker holding some of
them SIGKILLed mid-run.

Checked: every stream completes with no error; its text is, byte for byte,
the text an uninterrupted run of the same request sent through the same
gateway (so no response missing, none twice); its final response counts the
whole generation (the prompt's tokens, every completion token); the killed
worker had streams open, unfinished, when it died (both workers are frozen
with SIGSTOP once every stream has begun, the one holding more streams is
SIGKILLed, the other goes on), each of them resumed on the other worker, and
the gateway counts the resumes.
"""

from __future__ import annotations

import shutil
import signal
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest
from google.protobuf import text_format

from models.decoder import DecoderShape, build_tiny_lm, tiny_lm_config

from tests.harness import Proc, start, start_together, start_worker, worker_url
from tests.integration.gateway.stream_clients import GatewayCluster, metric, poll
from tests.integration.workers.gen_client import Generation, GenStream

pytestmark = pytest.mark.timeout(180)

PROMPTS = ["Once upon a time", "The quick brown fox", "été", "Hello, world", "In the beginning",
           "A B C", "lorem ipsum dolor", "0123456789", "zebra", "Why?", "sky", "tiny lm"]


@dataclass
class Cluster(GatewayCluster):
    model: str = ""


@contextmanager
def two_workers(repo: Path, model: str, tmp_path: Path) -> Iterator[Cluster]:
    workers = start_together([lambda: start_worker(repo)] * 2)
    try:
        config = tmp_path / "gateway.yaml"
        config.write_text("probe:\n  interval_s: 0.5\n")
        args = ["gateway", "--http-port", "0", "--grpc-port", "0", "--config", str(config)]
        for w in workers:
            args += ["--worker", worker_url(w)]
        gateway = start(args)
        try:
            found = Cluster(workers, gateway, model)
            poll(lambda: metric(found.http_url, "infergate_model_replicas", f'model="{model}"') == 2,
                 f"both workers serving {model} through the gateway", timeout_s=60.0)
            yield found
        finally:
            gateway.stop()
    finally:
        for w in workers:
            w.stop(check=False)


# tiny_lm's decoder, wider and deeper: tiny_lm itself generates 480 tokens in under 0.1 s, before a
# client has read its first few; this one takes about a second, as a real model's generation lasts
# long beside what it takes to freeze its worker.
WIDE_LM = DecoderShape(d_model=256, heads=4, layers=4, d_ff=1024)


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    repo = tmp_path / "models"
    (repo / "wide_lm" / "1").mkdir(parents=True)
    (repo / "wide_lm" / "1" / "model.onnx").write_bytes(build_tiny_lm(WIDE_LM, "wide_lm").SerializeToString())
    (repo / "wide_lm" / "config.pbtxt").write_text(text_format.MessageToString(tiny_lm_config("wide_lm", WIDE_LM)))
    with two_workers(repo, "wide_lm", tmp_path) as found:
        yield found


def run_all(cluster: Cluster, tag: str, count: int, max_tokens: int) -> tuple[GenStream, list[Generation]]:
    stream = GenStream(cluster.grpc_url)
    generations = [stream.send(cluster.model, f"{tag}-{i}", PROMPTS[i % len(PROMPTS)], max_tokens=max_tokens,
                               temperature=0.0, parameters={"ignore_eos": True}) for i in range(count)]
    return stream, generations


def wait_done(generations: list[Generation], timeout_s: float = 120.0) -> None:
    for g in generations:
        assert g.done.wait(timeout_s), f"a stream unfinished after {timeout_s}s: {len(g.tokens)} tokens"


def check_survives(cluster: Cluster, count: int, max_tokens: int) -> None:
    stream, expected = run_all(cluster, "whole", count, max_tokens)
    try:
        wait_done(expected)
    finally:
        stream.close()
    assert all(g.error is None and g.completion_tokens == max_tokens for g in expected), \
        [(g.error, g.completion_tokens) for g in expected]

    resumed_before = metric(cluster.http_url, "infergate_stream_resumes_total", f'model="{cluster.model}"')
    stream, generations = run_all(cluster, "cut", count, max_tokens)
    try:
        # Once every stream has begun (its first response has come: a stream is resumed only after
        # it), both workers are frozen where they are; a generation here lasts about a second.
        poll(lambda: all(g.tokens for g in generations), "every stream under way")
        frozen = list(cluster.workers)
        for w in frozen:
            w.kill(signal.SIGSTOP)
        killed = None
        try:
            victim = max(cluster.workers, key=cluster.inflight)
            open_on_victim = cluster.inflight(victim)
            # Streams that ended before the freeze (a loaded machine starts some late) are checked as the
            # others are; every stream still open on the victim has begun, so each is resumed.
            assert open_on_victim >= 1, [(len(g.tokens), g.done.is_set(), g.error) for g in generations]
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
    resumed = metric(cluster.http_url, "infergate_stream_resumes_total", f'model="{cluster.model}"') - resumed_before
    assert resumed == open_on_victim, (resumed, open_on_victim)


def test_greedy_streams_whose_worker_is_killed_go_on_on_the_other_unchanged(cluster: Cluster) -> None:
    check_survives(cluster, count=8, max_tokens=200)


@pytest.mark.slow
def test_sixteen_long_streams_survive_their_worker(cluster: Cluster) -> None:
    check_survives(cluster, count=16, max_tokens=480)



@pytest.fixture
def llama_cluster(tmp_path: Path) -> Iterator[Cluster]:
    """A Llama as optimum exports it (its own tokenizer, text by incremental decode), wide enough that a
    generation lasts beside what it takes to freeze its worker."""
    for package in ("torch", "transformers", "optimum.exporters.onnx"):
        pytest.importorskip(package)
    from tests.fixtures.hf_decoders import build_source, export

    repo = tmp_path / "models"
    export(build_source(tmp_path / "source", hidden=256, layers=4), repo / "llama" / "1")
    with two_workers(repo, "llama", tmp_path) as found:
        yield found


@pytest.mark.slow
def test_an_exported_llama_s_streams_survive_their_worker_too(llama_cluster: Cluster) -> None:
    # Its tokens are a real tokenizer's (several bytes, characters held across tokens): the resumed text
    # still joins to the uninterrupted one byte for byte.
    check_survives(llama_cluster, count=8, max_tokens=400)
