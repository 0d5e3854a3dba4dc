"""The Prometheus text format (0.0.4) that the gateway and the worker serve.

:func:`render_text` differs from prometheus-client's own writer in one way:
counters built with bare sample names (Triton's, e.g.
``nv_inference_request_success``) keep them rather than gaining a ``_total``
suffix, so dashboards written for Triton work unchanged. Counters built with
``CounterMetricFamily`` keep their ``_total`` samples as usual.

:class:`ModelCounters` declares Triton's per-model ``nv_inference_*`` counters
once for both servers: the names and labels are Triton's, the help texts too
unless a server's numbers mean something else.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from prometheus_client.core import Metric
from prometheus_client.registry import Collector
from prometheus_client.samples import Sample
from prometheus_client.utils import floatToGoString

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
MODEL_LABELS = ("model", "version")
_TEXT_TYPES = {"unknown": "untyped", "info": "gauge", "stateset": "gauge", "gaugehistogram": "histogram"}


def _escape_label(value: str) -> str:
    return value.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")


def _value(value: float) -> str:
    # Counters of events are ints: write them as such, as Triton does.
    return str(value) if type(value) is int else floatToGoString(value)


def _sample_line(sample: Sample) -> str:
    if sample.labels:
        labels = ",".join(f'{k}="{_escape_label(str(v))}"' for k, v in sorted(sample.labels.items()))
        return f"{sample.name}{{{labels}}} {_value(sample.value)}\n"
    return f"{sample.name} {_value(sample.value)}\n"


def render_text(collectors: Iterable[Collector]) -> bytes:
    """The Prometheus text exposition of every family the collectors yield."""
    out: list[str] = []
    for collector in collectors:
        for metric in collector.collect():
            name = metric.name
            if metric.type == "counter" and any(s.name == name + "_total" for s in metric.samples):
                name += "_total"
            doc = metric.documentation.replace("\\", r"\\").replace("\n", r"\n")
            out.append(f"# HELP {name} {doc}\n# TYPE {name} {_TEXT_TYPES.get(metric.type, metric.type)}\n")
            out.extend(_sample_line(s) for s in metric.samples if not s.name.endswith("_created"))
    return "".join(out).encode()


class TritonCounter(Metric):
    """A counter whose samples carry the family's bare name, as Triton writes them."""

    def __init__(self, name: str, documentation: str, labels: list[str]) -> None:
        super().__init__(name, documentation, "counter")
        self._labelnames = labels

    def add_metric(self, labels: list[str], value: float) -> None:
        self.samples.append(Sample(self.name, dict(zip(self._labelnames, labels)), value, None, None))


# Triton's per-model counters, by field of :class:`ModelCounters`: the family's name and Triton's help text.
_MODEL_COUNTERS = {
    "success": ("nv_inference_request_success", "Number of successful inference requests, all batch sizes"),
    "failure": ("nv_inference_request_failure", "Number of failed inference requests, all batch sizes"),
    "count": ("nv_inference_count", "Number of inferences performed (does not include cached requests)"),
    "execs": ("nv_inference_exec_count", "Number of model executions performed"),
    "request_us": ("nv_inference_request_duration_us", "Cumulative inference request duration in microseconds"),
    "queue_us": ("nv_inference_queue_duration_us", "Cumulative inference queuing duration in microseconds"),
    "infer_us": ("nv_inference_compute_infer_duration_us", "Cumulative compute inference duration in microseconds"),
}


@dataclass(frozen=True, slots=True)
class ModelCounters:
    """Triton's per-model counter families (``nv_inference_*``) over ``model`` and ``version``, as both servers
    write them; ``failure`` adds the labels that say why."""

    success: TritonCounter
    failure: TritonCounter
    count: TritonCounter
    execs: TritonCounter
    request_us: TritonCounter
    queue_us: TritonCounter
    infer_us: TritonCounter

    @classmethod
    def declare(cls, failure_labels: Sequence[str] = ("reason",), **help_texts: str) -> ModelCounters:
        """Empty families with Triton's help texts, or the server's own (``help_texts``, by field) where its
        numbers mean something else than Triton's."""
        unknown = set(help_texts) - set(_MODEL_COUNTERS)
        if unknown:
            raise TypeError(f"no Triton model counter {sorted(unknown)}")
        return cls(**{
            field: TritonCounter(name, help_texts.get(field, text),
                                 [*MODEL_LABELS, *failure_labels] if field == "failure" else list(MODEL_LABELS))
            for field, (name, text) in _MODEL_COUNTERS.items()
        })

    def families(self) -> tuple[TritonCounter, ...]:
        return (self.success, self.failure, self.count, self.execs, self.request_us, self.queue_us, self.infer_us)
