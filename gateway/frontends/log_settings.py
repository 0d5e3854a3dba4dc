"""Triton's logging extension at the gateway: the log settings a client reads
and updates (``/v2/logging``, gRPC ``LogSettings``), applied to this
process's Python logging.

Triton's settings and what they do here:

- ``log_info`` / ``log_warning`` / ``log_error``: let INFO / WARNING /
  ERROR-and-above records through the root logger's handlers, or drop them;
- ``log_verbose_level``: 0 leaves DEBUG records out; 1 and above lets them
  through (the root logger's level goes to DEBUG, and back on 0);
- ``log_format``: ``default`` (the gateway's own format) or ``ISO8601``
  (timestamps as ``YYYY-MM-DDThh:mm:ssZ``, UTC);
- ``log_file``: reported (empty: standard error) but, as in Triton, not
  changeable over the network.

One :class:`LogSettings` per process, shared by both frontends (they update
through :meth:`LogSettings.apply`, which a process group's settings extend to
every process of the gateway). It touches the process's logging only once a
client updates a setting (the filter goes onto the root logger's handlers
then). Messages are Triton's where it has them.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from typing import Any

from protos.errors import InvalidArgument, Unsupported

_BOOL_KEYS = {"log_info": logging.INFO, "log_warning": logging.WARNING, "log_error": logging.ERROR}
FORMATS = ("default", "ISO8601")
_ISO_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class _IsoFormatter(logging.Formatter):
    converter = time.gmtime

    def __init__(self) -> None:
        super().__init__(_ISO_FORMAT, datefmt="%Y-%m-%dT%H:%M:%SZ")


class LogSettings(logging.Filter):
    """The current settings, and the filter on the root handlers that applies them."""

    def __init__(self, root: logging.Logger | None = None) -> None:
        super().__init__()
        self._root = root or logging.getLogger()
        self._startup_level = self._root.level
        self._enabled = {key: True for key in _BOOL_KEYS}
        # Started with --log-level DEBUG: verbose from the start.
        self._verbose = 1 if self._root.getEffectiveLevel() <= logging.DEBUG else 0
        self._format = "default"
        self._formatters: dict[logging.Handler, logging.Formatter | None] = {}

    def _attach(self) -> None:
        for handler in self._root.handlers:
            if self not in handler.filters:
                handler.addFilter(self)

    def close(self) -> None:
        """Take the filter off the handlers and put their formatters back."""
        for handler in self._root.handlers:
            handler.removeFilter(self)
        self._apply_format("default")

    # -- logging.Filter

    def filter(self, record: logging.LogRecord) -> bool:
        level = record.levelno
        if level >= logging.ERROR:
            return self._enabled["log_error"]
        if level >= logging.WARNING:
            return self._enabled["log_warning"]
        if level >= logging.INFO:
            return self._enabled["log_info"]
        return self._verbose > 0

    # -- the extension

    def current(self) -> dict[str, Any]:
        """The settings in Triton's shape (the response of GET and POST ``/v2/logging``)."""
        files = [getattr(h, "baseFilename", "") for h in self._root.handlers]
        return {
            "log_file": next((f for f in files if f), ""),
            **self._enabled,
            "log_verbose_level": self._verbose,
            "log_format": self._format,
        }

    def update(self, settings: Mapping[str, Any]) -> dict[str, Any]:
        """Apply ``settings`` (all checked before any is applied); null values are skipped, as in Triton."""
        wanted = {key: value for key, value in settings.items() if value is not None}
        for key, value in wanted.items():
            if key == "log_file":
                raise Unsupported("log file location can not be updated through network protocol")
            if key in _BOOL_KEYS:
                if not isinstance(value, bool):
                    raise InvalidArgument(f"log setting '{key}' must be a boolean, got {value!r}")
            elif key == "log_verbose_level":
                if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 2**31:
                    raise InvalidArgument(f"log setting '{key}' must be a non-negative integer, got {value!r}")
            elif key == "log_format":
                if value not in FORMATS:
                    raise InvalidArgument(f"invalid argument for --log_format, got: {value}")
            else:
                raise InvalidArgument(
                    f"unknown log setting '{key}'; the settings are log_file, log_info, log_warning, "
                    "log_error, log_verbose_level and log_format"
                )
        self._attach()  # handlers added since start (e.g. by a test harness) follow too
        for key, value in wanted.items():
            if key in _BOOL_KEYS:
                self._enabled[key] = value
            elif key == "log_verbose_level":
                self._verbose = value
                self._root.setLevel(logging.DEBUG if value > 0 else self._startup_level)
            elif key == "log_format":
                self._apply_format(value)
        return self.current()

    async def apply(self, settings: Mapping[str, Any]) -> dict[str, Any]:
        """An update as both frontends make it: here, :meth:`update`; a process group's applies it in every process."""
        return self.update(settings)

    def _apply_format(self, fmt: str) -> None:
        for handler in self._root.handlers:
            if fmt == "ISO8601":
                self._formatters.setdefault(handler, handler.formatter)
                handler.setFormatter(_IsoFormatter())
            elif handler in self._formatters:
                handler.setFormatter(self._formatters.pop(handler))
        self._format = fmt
