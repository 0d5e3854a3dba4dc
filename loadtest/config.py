"""What one ``infergate bench`` run does: :class:`BenchConfig`, and the parsers
of its perf_analyzer-style option strings.

The command line and the Python API (``run_bench``) both build one
``BenchConfig``; it validates itself on construction, so everything past this
module can trust it. Option strings follow perf_analyzer's forms:
``--concurrency-range 1:16:2`` (additive) or ``1:64:x2`` (multiplicative),
``--shape NAME:d1,d2``, ``--int-range LO:HI``, ``-H KEY:VALUE``, and
``--warmup 2s`` / ``500ms`` / ``100`` (a bare integer counts requests).
``streaming`` switches to decoupled models (``--streaming``): the levels are
open streams, and only the closed loop in one process applies.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum


class BenchError(Exception):
    """A problem the user can fix (bad option, unknown model, unusable input data)."""


class Protocol(str, Enum):
    GRPC = "grpc"
    HTTP = "http"
    OPENAI = "openai"  # the OpenAI-compatible API, generative mode only


class Distribution(str, Enum):
    CONSTANT = "constant"
    POISSON = "poisson"


class LoadMode(str, Enum):
    CONCURRENCY = "concurrency"  # closed loop: N requests always in flight
    REQUEST_RATE = "request_rate"  # open loop: requests sent on a schedule


DEFAULT_PORTS = {Protocol.GRPC: 8001, Protocol.HTTP: 8000, Protocol.OPENAI: 8000}
STABILITY_WINDOWS = 3  # perf_analyzer: the last 3 windows must agree


@dataclass(frozen=True, slots=True)
class LoadRange:
    """The load levels to visit: start, start+step, ... (or start, start*factor, ...) up to end."""

    start: float
    end: float
    step: float
    multiplicative: bool = False

    def values(self) -> tuple[float, ...]:
        out: list[float] = []
        value = self.start
        # A relative epsilon so 0.1-steps of floats still reach the end value.
        limit = self.end * (1 + 1e-9) + 1e-12
        while value <= limit:
            out.append(round(value, 9))
            value = value * self.step if self.multiplicative else value + self.step
        return tuple(out)


def parse_range(text: str, *, integer: bool) -> LoadRange:
    """``START[:END[:STEP]]`` with STEP ``N`` (add) or ``xN`` (multiply)."""
    parts = text.strip().split(":")
    if not 1 <= len(parts) <= 3 or not all(parts):
        raise BenchError(f"range {text!r}: expected START[:END[:STEP]], e.g. 1:16:2 or 1:64:x2")
    number = int if integer else float
    kind = "an integer" if integer else "a number"
    try:
        start = number(parts[0])
        end = number(parts[1]) if len(parts) > 1 else start
    except ValueError:
        raise BenchError(f"range {text!r}: START and END must be {kind}") from None
    multiplicative = len(parts) == 3 and parts[2][0] in "xX*"
    step_text = parts[2][1:] if multiplicative else (parts[2] if len(parts) == 3 else "1")
    try:
        step = float(step_text) if multiplicative or not integer else int(step_text)
    except ValueError:
        raise BenchError(f"range {text!r}: STEP must be {kind} or xFACTOR") from None
    if start <= 0 or end < start:
        raise BenchError(f"range {text!r}: need 0 < START <= END")
    if multiplicative and step <= 1:
        raise BenchError(f"range {text!r}: a multiplicative step must be above 1 (e.g. x2)")
    if not multiplicative and step <= 0:
        raise BenchError(f"range {text!r}: STEP must be positive")
    return LoadRange(float(start), float(end), float(step), multiplicative)


def parse_warmup(text: str) -> tuple[float, int]:
    """``2s``, ``500ms`` -> (seconds, 0); ``100`` -> (0, requests)."""
    value = text.strip().lower()
    try:
        if value.endswith("ms"):
            seconds, requests = float(value[:-2]) / 1000.0, 0
        elif value.endswith("s"):
            seconds, requests = float(value[:-1]), 0
        else:
            seconds, requests = 0.0, int(value)
    except ValueError:
        raise BenchError(f"--warmup {text!r}: give seconds (2s, 500ms) or a request count (100)") from None
    if seconds < 0 or requests < 0 or math.isnan(seconds):
        raise BenchError(f"--warmup {text!r} is negative")
    return seconds, requests


def parse_shape(text: str) -> tuple[str, tuple[int, ...]]:
    """``NAME:d1,d2`` -> (NAME, (d1, d2)); dims exclude the batch dimension."""
    name, sep, dims = text.rpartition(":")
    if not sep or not name:
        raise BenchError(f"--shape {text!r}: expected NAME:d1,d2 (dims without the batch dimension)")
    try:
        shape = tuple(int(d) for d in dims.split(",")) if dims.strip() else ()
    except ValueError:
        raise BenchError(f"--shape {text!r}: dims must be integers") from None
    if any(d < 0 for d in shape):
        raise BenchError(f"--shape {text!r}: dims must be actual sizes, not -1")
    return name, shape


def parse_int_range(text: str) -> tuple[int, int]:
    """``LO:HI`` -> (LO, HI), the half-open range of random integer inputs."""
    lo, sep, hi = text.partition(":")
    try:
        low, high = int(lo), int(hi)
    except ValueError:
        raise BenchError(f"--int-range {text!r}: expected LO:HI integers, e.g. 0:1000") from None
    if not sep or high <= low:
        raise BenchError(f"--int-range {text!r}: need LO < HI")
    return low, high


def parse_header(text: str) -> tuple[str, str]:
    """``KEY:VALUE`` -> (KEY, VALUE); the value may itself hold colons."""
    key, sep, value = text.partition(":")
    if not sep or not key.strip():
        raise BenchError(f"-H {text!r}: expected KEY:VALUE")
    return key.strip(), value.strip()


@dataclass(frozen=True, slots=True)
class BenchConfig:
    """One benchmark run. Give ``concurrency`` (closed loop) or ``request_rate`` (open loop)."""

    model: str
    url: str = ""  # HOST:PORT; empty means localhost on the protocol's default port
    protocol: Protocol = Protocol.HTTP
    model_version: str = ""
    batch_size: int = 1
    concurrency: tuple[int, ...] = ()
    request_rate: tuple[float, ...] = ()
    distribution: Distribution = Distribution.CONSTANT
    measurement_interval_ms: int = 5000
    stability_percentage: float = 10.0
    max_trials: int = 10
    request_count: int = 0  # > 0: each level sends exactly this many requests instead of time windows
    warmup_s: float = 0.0
    warmup_requests: int = 0
    input_data: str = "random"  # random | zero | path to a perf_analyzer JSON data file
    shapes: Mapping[str, tuple[int, ...]] = field(default_factory=dict)
    seed: int = 0
    int_range: tuple[int, int] = (0, 100)
    string_length: int = 16
    http_binary: bool = False
    timeout_ms: int = 30_000
    headers: tuple[tuple[str, str], ...] = ()
    processes: int = 1
    max_outstanding: int = 4096  # open loop: requests in flight per process before sends wait
    progress: bool = False
    # Decoupled models: one open stream per concurrency slot, every response read
    # (gRPC ModelStreamInfer, or HTTP generate_stream).
    streaming: bool = False
    # Generative models (``--generate``, implies streaming): prompts of ``prompt_tokens``
    # bytes asking ``output_tokens`` tokens each (``loadtest.generate``).
    generate: bool = False
    prompt_tokens: int = 64
    output_tokens: int = 64
    # Shared openings (genai-perf's --num-prefix-prompts / --prefix-prompt-length): each prompt
    # opens with one of ``prefix_prompts`` seeded openings of ``prefix_tokens`` bytes, before its own.
    prefix_prompts: int = 0
    prefix_tokens: int = 0

    def __post_init__(self) -> None:
        # Accept plain strings from Python callers; store the enums.
        try:
            object.__setattr__(self, "protocol", Protocol(self.protocol))
            object.__setattr__(self, "distribution", Distribution(self.distribution))
        except ValueError as exc:
            raise BenchError(str(exc)) from None
        object.__setattr__(self, "concurrency", tuple(int(c) for c in self.concurrency))
        object.__setattr__(self, "request_rate", tuple(float(r) for r in self.request_rate))
        object.__setattr__(self, "shapes", {k: tuple(v) for k, v in dict(self.shapes).items()})
        object.__setattr__(self, "headers", tuple((str(k), str(v)) for k, v in self.headers))
        url = self.url.split("://", 1)[-1].rstrip("/") or f"localhost:{DEFAULT_PORTS[self.protocol]}"
        object.__setattr__(self, "url", url)
        if not self.concurrency and not self.request_rate:
            object.__setattr__(self, "concurrency", (1,))
        if self.generate:
            object.__setattr__(self, "streaming", True)
        self._validate()

    def _validate(self) -> None:
        if not self.model:
            raise BenchError("a model name is required (-m MODEL)")
        if self.concurrency and self.request_rate:
            raise BenchError("give either a concurrency range or a request-rate range, not both")
        if any(c <= 0 for c in self.concurrency) or any(r <= 0 for r in self.request_rate):
            raise BenchError("load levels must be positive")
        checks = (
            (self.batch_size >= 1, "-b/--batch-size must be >= 1"),
            (self.measurement_interval_ms > 0, "--measurement-interval must be > 0 ms"),
            (self.stability_percentage > 0, "--stability-percentage must be > 0"),
            (self.max_trials >= 1, "--max-trials must be >= 1"),
            (self.request_count >= 0, "--request-count must be >= 0"),
            (self.warmup_s >= 0 and self.warmup_requests >= 0, "--warmup must not be negative"),
            (self.timeout_ms > 0, "--timeout-ms must be > 0"),
            (self.processes >= 1, "--processes must be >= 1"),
            (self.max_outstanding >= 1, "--max-outstanding must be >= 1"),
            (self.int_range[0] < self.int_range[1], "--int-range needs LO < HI"),
            (self.string_length >= 0, "--string-length must be >= 0"),
        )
        for ok, message in checks:
            if not ok:
                raise BenchError(message)
        if self.streaming and self.request_rate:
            raise BenchError("--streaming measures open streams: give --concurrency-range, not --request-rate-range")
        if self.protocol is Protocol.OPENAI and not self.generate:
            raise BenchError("-i openai measures generation: add --generate")
        if self.generate and (self.prompt_tokens < 1 or self.output_tokens < 1):
            raise BenchError("--prompt-tokens and --output-tokens must be >= 1")
        if self.prefix_prompts < 0 or self.prefix_tokens < 0 or (self.prefix_prompts > 0) != (self.prefix_tokens > 0):
            raise BenchError("--num-prefix-prompts and --prefix-prompt-length go together, both >= 1")
        if self.streaming and self.processes > 1:
            raise BenchError("--streaming runs in one client process: drop --processes")
        host, sep, port = self.url.rpartition(":")
        if not sep or not host or not port.isdigit():
            raise BenchError(f"-u {self.url!r}: expected HOST:PORT")

    @property
    def mode(self) -> LoadMode:
        return LoadMode.REQUEST_RATE if self.request_rate else LoadMode.CONCURRENCY

    @property
    def levels(self) -> tuple[float, ...]:
        return self.request_rate if self.request_rate else tuple(float(c) for c in self.concurrency)

    @property
    def timeout_s(self) -> float:
        return self.timeout_ms / 1000.0

    @property
    def interval_s(self) -> float:
        return self.measurement_interval_ms / 1000.0
