"""The worker's packed stream writer (``workers.stream_writers``), with a fake call context.

Responses queued in one turn of the event loop leave as one packed message,
in order; later ones go in the next message; a run of responses is cut
where it would pass ``PACK_MAX_BYTES`` (a large response goes alone);
closing sends what is queued; a request alone on the call writes its own
response at once, and what others queue meanwhile follows it.
"""

from __future__ import annotations

import asyncio

from tritonclient.grpc import service_pb2

from protos.stream_pack import unpack
from workers.stream_writers import PACK_MAX_BYTES, PackedWriter


class FakeContext:
    def __init__(self) -> None:
        self.messages: list[service_pb2.ModelStreamInferResponse] = []

    async def write(self, message: service_pb2.ModelStreamInferResponse) -> None:
        self.messages.append(message)
        await asyncio.sleep(0)  # a write completes later, as gRPC's does


def response(rid: str, size: int = 4) -> service_pb2.ModelStreamInferResponse:
    message = service_pb2.ModelStreamInferResponse()
    message.infer_response.id = rid
    message.infer_response.raw_output_contents.append(rid.encode()[:1] * size)
    return message


def carried(context: FakeContext) -> list[list[str]]:
    return [[r.infer_response.id for r in unpack(m)] for m in context.messages]


async def test_one_turns_responses_leave_as_one_message_in_order() -> None:
    context = FakeContext()
    writer = PackedWriter(context, lone=lambda: False)  # type: ignore[arg-type]

    async def sequence(rid: str) -> None:
        await writer.write(response(rid))

    await asyncio.gather(*(sequence(f"s{i}") for i in range(5)))
    await writer.write(response("later"))
    await writer.close()
    assert carried(context) == [["s0", "s1", "s2", "s3", "s4"], ["later"]]
    assert context.messages[1].infer_response.id == "later"  # a lone response is not packed


async def test_a_run_is_cut_before_it_passes_the_byte_cap() -> None:
    context = FakeContext()
    writer = PackedWriter(context, lone=lambda: False)  # type: ignore[arg-type]
    half = PACK_MAX_BYTES // 2
    for rid, size in (("a", 10), ("b", 10), ("c", 2 * PACK_MAX_BYTES), ("d", half), ("e", half - 1000), ("f", half)):
        await writer.write(response(rid, size))
    await writer.close()
    assert carried(context) == [["a", "b"], ["c"], ["d", "e"], ["f"]]
    assert all(len(m.SerializeToString()) <= PACK_MAX_BYTES for m in context.messages if len(unpack(m)) > 1)


async def test_a_lone_request_writes_at_once_and_what_comes_meanwhile_follows() -> None:
    context = FakeContext()
    lone = [True]
    writer = PackedWriter(context, lone=lambda: lone[0])  # type: ignore[arg-type]
    first = asyncio.ensure_future(writer.write(response("solo")))
    await asyncio.sleep(0)  # its write is in flight
    assert carried(context) == [["solo"]]
    lone[0] = False  # others joined the call
    await asyncio.gather(writer.write(response("x1")), writer.write(response("x2")), first)
    await writer.close()
    assert carried(context) == [["solo"], ["x1", "x2"]]


async def test_a_failed_write_fails_the_writes_after_it_instead_of_queueing_them() -> None:
    class Broken(FakeContext):
        async def write(self, message: service_pb2.ModelStreamInferResponse) -> None:
            raise ConnectionError("the call is broken")

    writer = PackedWriter(Broken(), lone=lambda: False)  # type: ignore[arg-type]
    await writer.write(response("a"))  # queued; the writing task fails on it
    await asyncio.sleep(0)
    try:
        await writer.write(response("b"))
    except RuntimeError as e:
        assert isinstance(e.__cause__, ConnectionError)
    else:
        raise AssertionError("a write after the writer failed was queued")
    writer.cancel()
