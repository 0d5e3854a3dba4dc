"""Background tasks that cannot die silently.

A long-lived task (a heartbeat loop, a placement round, a DNS refresh) has an
owner that keeps it, but nobody awaits it until shutdown: if it raised, the
error would wait there unseen while the work it did stops. Every such task
gets :func:`log_task_death` as its done-callback, so its death is logged at
once, with the task's name and traceback.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

log = logging.getLogger(__name__)


def log_task_death(task: asyncio.Task[Any]) -> None:
    """Done-callback: log the task's exception, if it died of one (a cancel is a normal end)."""
    if not task.cancelled() and task.exception() is not None:
        log.error("task %s died", task.get_name(), exc_info=task.exception())
