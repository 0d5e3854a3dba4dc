"""serverkit/tasks.py: a background task's death is logged with its name and traceback; a cancel is not."""

from __future__ import annotations

import asyncio
import logging

import pytest

from serverkit.tasks import log_task_death


async def test_a_task_that_dies_is_logged_by_name_and_a_cancelled_one_is_not(caplog: pytest.LogCaptureFixture) -> None:
    async def fail() -> None:
        raise ValueError("lost the thread")

    caplog.set_level(logging.ERROR, logger="serverkit.tasks")
    dying = asyncio.create_task(fail(), name="heartbeat")
    dying.add_done_callback(log_task_death)
    cancelled = asyncio.create_task(asyncio.sleep(60), name="placement")
    cancelled.add_done_callback(log_task_death)
    cancelled.cancel()
    await asyncio.gather(dying, cancelled, return_exceptions=True)
    await asyncio.sleep(0)  # done-callbacks run on the next turn of the loop
    [record] = caplog.records
    assert record.getMessage() == "task heartbeat died"
    assert record.exc_info is not None and "lost the thread" in str(record.exc_info[1])
