"""Summing several gateway processes' answers into the whole gateway's.

Counts and durations add up exactly, so totals equal the requests sent.
Triton statistics: every integer field sums, ``last_inference`` takes the
latest, batch statistics merge by batch size. Prometheus: counters and
histograms sum sample by sample (bucket-wise); gauges of load (queue depth,
in-flight) sum, gauges of the shared view (a worker's state, a model's
replicas, a queue's capacity) are the same in every process and are taken
once; ``PER_PROCESS`` families keep one series per process (a ``process``
label). Cluster documents: per-worker and per-model counters sum on top of
one process's view.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Iterator
from typing import Any

from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families
from tritonclient.grpc import service_pb2

from serverkit.prometheus import render_text

# Repeated statistics messages are matched on these fields; the rest sum.
_KEYS = {"batch_stats": ("batch_size",), "memory_usage": ("type", "id")}
_LATEST = {"last_inference"}
# Gauges that describe the shared view: every process reports the same value.
VIEW_GAUGES = frozenset({
    "infergate_worker_state", "infergate_model_replicas", "infergate_worker_models", "infergate_queue_capacity",
    "infergate_worker_ejected", "infergate_parallel_groups_ready", "infergate_cache_capacity_bytes",
    "process_max_fds",
    # Every process reads the same workers' generation figures.
    "infergate_generation_worker_sequences_running", "infergate_generation_worker_sequences_waiting",
    "infergate_generation_worker_cache_bytes", "infergate_generation_worker_cache_reserved_bytes",
})
_EARLIEST = frozenset({"process_start_time_seconds"})
# Families shown per process (a ``process`` label added), not summed: who does what.
PER_PROCESS = frozenset({"infergate_placement_rounds"})
_REQUEST_FAMILIES = ("nv_inference_request_success", "nv_inference_request_failure")


def _repeated(field: FieldDescriptor) -> bool:
    # ``is_repeated`` on newer protobuf, where ``label`` is gone.
    repeated = getattr(field, "is_repeated", None)
    return bool(repeated) if repeated is not None else field.label == FieldDescriptor.LABEL_REPEATED


def _add(into: Message, other: Message, keys: tuple[str, ...] = ()) -> None:
    """Add ``other``'s counts into ``into``; ``keys`` are the fields the two were matched on."""
    for field, value in other.ListFields():
        name = field.name
        if name in keys:
            continue
        if field.type == FieldDescriptor.TYPE_MESSAGE:
            target = getattr(into, name)
            if field.message_type.GetOptions().map_entry:
                for key, item in value.items():
                    _add(target[key], item)
            elif _repeated(field):
                _add_repeated(target, value, _KEYS.get(name, ()))
            else:
                _add(target, value)
        elif name in _LATEST:
            setattr(into, name, max(getattr(into, name), value))
        elif field.cpp_type in (FieldDescriptor.CPPTYPE_INT32, FieldDescriptor.CPPTYPE_INT64,
                                FieldDescriptor.CPPTYPE_UINT32, FieldDescriptor.CPPTYPE_UINT64,
                                FieldDescriptor.CPPTYPE_DOUBLE, FieldDescriptor.CPPTYPE_FLOAT) and not _repeated(field):
            setattr(into, name, getattr(into, name) + value)
        elif not getattr(into, name):  # names, versions: the same everywhere
            setattr(into, name, value)


def _add_repeated(target: Any, items: Iterable[Message], key_fields: tuple[str, ...]) -> None:
    index = {tuple(getattr(m, k) for k in key_fields): m for m in target}
    for item in items:
        key = tuple(getattr(item, k) for k in key_fields)
        if key_fields and key in index:
            _add(index[key], item, key_fields)
        else:
            index[key] = target.add()
            index[key].CopyFrom(item)


def merge_statistics(responses: Iterable[service_pb2.ModelStatisticsResponse]) -> service_pb2.ModelStatisticsResponse:
    """One ``ModelStatisticsResponse`` whose counts are the sums of all of them, ordered by (model, version)."""
    merged: dict[tuple[str, str], service_pb2.ModelStatistics] = {}
    for response in responses:
        for stats in response.model_stats:
            key = (stats.name, stats.version)
            if key in merged:
                _add(merged[key], stats)
            else:
                merged[key] = service_pb2.ModelStatistics()
                merged[key].CopyFrom(stats)
    out = service_pb2.ModelStatisticsResponse()
    for key in sorted(merged):
        stats = merged[key]
        batches = sorted((b.batch_size, b.SerializeToString()) for b in stats.batch_stats)
        del stats.batch_stats[:]
        for _, data in batches:
            stats.batch_stats.add().ParseFromString(data)
        out.model_stats.append(stats)
    return out


def _number(value: float) -> float:
    # Counts come back from the text as floats; whole numbers are written as ints again, as Triton does.
    return int(value) if float(value).is_integer() and abs(value) < 2**53 else value


class _Families:
    def __init__(self, families: list[Metric]) -> None:
        self.families = families

    def collect(self) -> Iterator[Metric]:
        yield from self.families


def merge_metrics(texts: list[str]) -> bytes:
    """The Prometheus text of N processes (``texts[i]`` from process ``i``) as one gateway's."""
    order: list[str] = []
    families: dict[str, Metric] = {}
    samples: dict[str, dict[tuple[str, tuple[tuple[str, str], ...]], float]] = {}
    requests = []
    for index, text in enumerate(texts):
        answered = 0.0
        # The parser names every counter's samples ``*_total``; Triton's bare counters keep their names.
        bare = {line.split()[2] for line in text.splitlines()
                if line.startswith("# TYPE ") and line.endswith(" counter") and not line.split()[2].endswith("_total")}
        for family in text_string_to_metric_families(text):
            if family.name not in families:
                order.append(family.name)
                families[family.name] = Metric(family.name, family.documentation, family.type)
                samples[family.name] = {}
            into = samples[family.name]
            for s in family.samples:
                sample_name = s.name.removesuffix("_total") if family.name in bare else s.name
                labels = {**s.labels, "process": str(index)} if family.name in PER_PROCESS else s.labels
                key = (sample_name, tuple(sorted(labels.items())))
                if family.name in _REQUEST_FAMILIES:
                    answered += s.value
                if key not in into:
                    into[key] = s.value
                elif family.type == "gauge" and family.name in VIEW_GAUGES:
                    into[key] = max(into[key], s.value)
                elif family.name in _EARLIEST:
                    into[key] = min(into[key], s.value)
                else:
                    into[key] += s.value
        requests.append(answered)
    out = []
    for name in order:
        metric = families[name]
        for (sample_name, labels), value in samples[name].items():
            metric.add_sample(sample_name, dict(labels), _number(value))
        out.append(metric)
    per_process = CounterMetricFamily("infergate_process_requests",
                                      "Inference requests answered (successes and failures) by each gateway process",
                                      labels=["process"])
    for index, n in enumerate(requests):
        per_process.add_metric([str(index)], _number(n))
    out.append(GaugeMetricFamily("infergate_gateway_processes", "Gateway processes sharing the ports",
                                 value=len(texts)))
    out.append(per_process)
    return render_text([_Families(out)])


def _sum_fields(into: dict[str, Any], other: dict[str, Any], fields: Iterable[str]) -> None:
    for f in fields:
        into[f] = into.get(f, 0) + other.get(f, 0)


def merge_cluster_view(docs: list[dict[str, Any]]) -> dict[str, Any]:
    """``/v2/cluster``: the first document's view, with load counters and queue depths summed.

    Each process judges light models on its own calls: a model's ``light`` is the
    verdict every process that has judged agrees on (null while none has, or when
    they differ), ``light_by_process`` each one's, ``worker_ms_per_row`` their median.
    """
    base = docs[0]
    workers = {w["address"]: w for w in base["workers"]}
    models = {m["name"]: m for m in base["models"]}
    verdicts: dict[str, list[Any]] = {name: [m.get("light")] for name, m in models.items()}
    costs: dict[str, list[float]] = {name: [m["worker_ms_per_row"]] if m.get("worker_ms_per_row") is not None else []
                                     for name, m in models.items()}
    for doc in docs[1:]:
        for w in doc["workers"]:
            if w["address"] in workers:
                _sum_fields(workers[w["address"]]["load"], w["load"],
                            ("inflight_batches", "batches_sent", "failures", "retries"))
        for m in doc["models"]:
            if m["name"] in models:
                models[m["name"]]["queue_depth"] += m["queue_depth"]
                verdicts[m["name"]].append(m.get("light"))
                if m.get("worker_ms_per_row") is not None:
                    costs[m["name"]].append(m["worker_ms_per_row"])
    for name, m in models.items():
        judged = {v for v in verdicts[name] if v is not None}
        m["light"] = judged.pop() if len(judged) == 1 else None
        m["light_by_process"] = verdicts[name]
        m["worker_ms_per_row"] = round(statistics.median(costs[name]), 3) if costs[name] else None
    base["gateway"]["processes"] = len(docs)
    return base


# Bucket counts summed bucket-wise: end-to-end latency; a generative model's first token and token gaps.
_HISTOGRAMS = ("latency_counts", "ttft_counts", "itl_counts")


def merge_cluster_stats(docs: list[dict[str, Any]]) -> dict[str, Any]:
    """``/v2/cluster/stats``: every model's and worker's counters summed (latency histograms bucket-wise)."""
    models: dict[tuple[str, str], dict[str, Any]] = {}
    workers: dict[str, dict[str, Any]] = {}
    for doc in docs:
        for m in doc["models"]:
            key = (m["model"], m["version"])
            if key not in models:
                models[key] = dict(m, **{h: list(m[h]) for h in _HISTOGRAMS if h in m})
                continue
            into = models[key]
            _sum_fields(into, m, ("success", "failure", "inferences", "executions", "batch_rows", "queue_depth",
                                  "latency_sum_s"))
            if "tokens" in m:  # a generative model's (observability.cluster_api)
                into["tokens"] = into.get("tokens", 0) + m["tokens"]
            for h in _HISTOGRAMS:
                counts = into.setdefault(h, [])
                counts.extend([0] * (len(m.get(h, ())) - len(counts)))
                for i, n in enumerate(m.get(h, ())):
                    counts[i] += n
        for w in doc["workers"]:
            if w["address"] not in workers:
                workers[w["address"]] = dict(w)
            else:
                _sum_fields(workers[w["address"]], w, ("inflight", "sent", "failures", "retries"))
    return {**docs[0], "models": [models[k] for k in sorted(models)], "workers": list(workers.values()),
            "processes": len(docs)}
