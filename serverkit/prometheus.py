"""The Prometheus text format (0.0.4) that the gateway and the worker serve.

:func:`render_text` differs from prometheus-client's own writer in one way:
counters built with bare sample names (Triton's, e.g.
``nv_inference_request_success``) keep them rather than gaining a ``_total``
suffix, so dashboards written for Triton work unchanged. Counters built with
``CounterMetricFamily`` keep their ``_total`` samples as usual.
"""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client.core import Metric
from prometheus_client.registry import Collector
from prometheus_client.samples import Sample
from prometheus_client.utils import floatToGoString

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
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
