"""``infergate up`` with one worker serving ``tiny_lm`` behind two gateway
processes: while streams generate, the gateway's (merged) ``/metrics`` shows
that worker's running sequences and KV cache (``infergate_generation_worker_*``)
and ``/v2/cluster`` lists them under the worker; once the streams end, both
return to 0. (A split decoder, generating at the gateway, shows the same way
as worker ``gateway``: checked in ``test_split_decoder.py`` on its cluster.)
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests

from tests.harness import Proc, start
from tests.integration.gateway.stream_clients import WORKER_GAUGES, figures, poll
from tests.integration.workers.gen_client import Generation, GenStream

pytestmark = pytest.mark.timeout(180)

@pytest.fixture(scope="module")
def up(model_repo: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proc]:
    repo = tmp_path_factory.mktemp("generation-usage")
    shutil.copytree(model_repo / "tiny_lm", repo / "tiny_lm")
    proc = start(["up", "--workers", "1", "--gateway-processes", "2", "--model-repository", str(repo),
                  "--http-port", "0", "--grpc-port", "0"])
    try:
        base = f"http://127.0.0.1:{proc.ready['http_port']}"
        poll(lambda: requests.get(f"{base}/v2/models/tiny_lm/ready", timeout=10).status_code == 200,
             "tiny_lm ready", timeout_s=60.0)
        yield proc
    finally:
        proc.stop()


def test_running_sequences_and_cache_per_worker(up: Proc) -> None:
    base = f"http://127.0.0.1:{up.ready['http_port']}"
    (worker,) = [w["address"] for w in requests.get(f"{base}/v2/cluster", timeout=10).json()["workers"]]
    stream = GenStream(f"127.0.0.1:{up.ready['grpc_port']}")
    try:
        for i in range(3):  # some whole generations first
            done = stream.generate("tiny_lm", f"warm-{i}", "Hello", max_tokens=8)
            assert done.error is None and done.completion_tokens > 0
        # Long streams, started again whenever all have ended, until the gateway has seen them run.
        holding: list[Generation] = []
        seen: dict[str, float] = {}

        def running() -> bool:
            if all(g.done.is_set() for g in holding):
                holding.extend(stream.send("tiny_lm", f"hold-{len(holding) + i}", "Once upon a time", max_tokens=480,
                                           parameters={"ignore_eos": True}) for i in range(3))
            seen.update(figures(up, worker))
            return seen.get("sequences_running", 0) > 0 and seen.get("cache_bytes", 0) > 0

        poll(running, "running sequences and KV cache on the gateway's /metrics", timeout_s=60.0)
        assert set(seen) == set(WORKER_GAUGES)
        assert seen["cache_reserved_bytes"] >= seen["cache_bytes"] > 0
        listed = {w["address"]: w["generation"] for w in requests.get(f"{base}/v2/cluster", timeout=10).json()["workers"]}
        assert set(listed[worker]) == {"tiny_lm"}
        assert set(listed[worker]["tiny_lm"]) == {"running", "waiting", "cache_bytes", "cache_reserved_bytes"}
    finally:
        stream.close(cancel=True)
    # Every stream ended (cancelled or finished): the worker's figures come back to 0.
    poll(lambda: figures(up, worker) == dict.fromkeys(WORKER_GAUGES, 0.0), "generation figures back to 0",
         timeout_s=60.0)


def test_a_continuation_named_by_its_text_alone_goes_on_as_by_its_ids(up: Proc) -> None:
    """A stream begun on an OpenAI-protocol server names no ids; its continuation on an infergate
    worker names the text sent (``resume_text``), which the worker tokenizes as the ids."""
    stream = GenStream(f"127.0.0.1:{up.ready['grpc_port']}")
    try:
        full = stream.generate("tiny_lm", "whole", "Once upon", max_tokens=12, parameters={"ignore_eos": True})
        assert full.error is None and full.completion_tokens == 12
        cut = next(k for k in range(4, len(full.tokens)) if _utf8(b"".join(full.tokens[:k])))
        sent = b"".join(full.tokens[:cut])
        rest = stream.generate("tiny_lm", "rest", "Once upon", max_tokens=12,
                               parameters={"ignore_eos": True, "resume_text": sent.decode()})
        assert rest.error is None
        assert sent + rest.text == full.text  # no byte twice, none missing
        assert (rest.prompt_tokens, rest.completion_tokens) == (full.prompt_tokens, 12)
    finally:
        stream.close()


def _utf8(data: bytes) -> bool:
    try:
        data.decode()
    except UnicodeDecodeError:
        return False
    return True
