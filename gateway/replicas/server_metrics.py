"""An LLM server's load as its Prometheus metrics state it: vLLM's and SGLang's names.

:func:`server_load` reads the text a server's ``GET /metrics`` answers and
keeps three figures (``gateway.replicas.replica.ServerLoad``): requests
waiting in its queue, requests running, and the share of its KV cache in
use. Each figure is the sum over the series of its name (one per served
model or engine); the cache use is the largest. A server that exposes none
of these names has no load to report (None).

vLLM: ``vllm:num_requests_waiting``, ``vllm:num_requests_running``,
``vllm:kv_cache_usage_perc`` (``vllm:gpu_cache_usage_perc`` before v0.10),
a fraction from 0 to 1 despite its name. SGLang: ``sglang:num_queue_reqs``,
``sglang:num_running_reqs``, ``sglang:token_usage``.
"""

from __future__ import annotations

import math

from gateway.replicas.replica import ServerLoad

_WAITING = ("vllm:num_requests_waiting", "sglang:num_queue_reqs")
_RUNNING = ("vllm:num_requests_running", "sglang:num_running_reqs")
_CACHE = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc", "sglang:token_usage")


def server_load(text: str) -> ServerLoad | None:
    """The load in a Prometheus text exposition, or None when it names none of the figures."""
    waiting = running = cache = 0.0
    seen = False
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name, value = _sample(line)
        if name is None:
            continue
        if name in _WAITING:
            waiting += value
        elif name in _RUNNING:
            running += value
        elif name in _CACHE:
            cache = max(cache, value)
        else:
            continue
        seen = True
    if not seen:
        return None
    return ServerLoad(waiting=waiting, running=running, cache_usage=min(1.0, max(0.0, cache)))


def _sample(line: str) -> tuple[str | None, float]:
    """The metric name and value of one sample line (``name{labels} value [timestamp]``)."""
    brace = line.find("{")
    if brace >= 0:
        name, rest = line[:brace], line[line.rfind("}") + 1:]
    else:
        name, _, rest = line.partition(" ")
    fields = rest.split()
    if not fields:
        return None, 0.0
    try:
        value = float(fields[0])
    except ValueError:
        return None, 0.0
    return (name.strip(), value) if math.isfinite(value) else (None, 0.0)
