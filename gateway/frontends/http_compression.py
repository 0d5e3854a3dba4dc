"""Compressed HTTP bodies: the bounded decompression of request bodies and the
choice of response coding (gzip, deflate or identity).

Nothing here touches aiohttp; ``gateway.frontends.http_api`` applies both.
A body that decompresses past its limit raises ``PayloadTooLarge``; a damaged
one ``InvalidArgument``.
"""

from __future__ import annotations

import zlib

from protos.errors import InvalidArgument, PayloadTooLarge

Buffer = bytes | bytearray | memoryview


def inflate_bounded(body: Buffer, encoding: str, limit: int) -> bytes:
    """Decompress a gzip (possibly multi-member) or deflate body to at most ``limit`` bytes.

    Output is produced in bounded steps, so a decompression bomb costs about
    ``limit`` bytes of memory before it is rejected with PayloadTooLarge.
    "deflate" means the zlib format (RFC 1950); a raw deflate stream, which
    some clients send instead, is accepted too.
    """
    is_gzip = encoding in ("gzip", "x-gzip")
    wbits = 31 if is_gzip else (15 if _has_zlib_header(body) else -15)
    data: Buffer = body
    out: list[bytes] = []
    total = 0
    decomp = zlib.decompressobj(wbits)
    try:
        while True:
            room = limit + 1 - total
            chunk = decomp.decompress(data, room)
            total += len(chunk)
            if total > limit:
                raise PayloadTooLarge(f"request body decompresses to more than the limit of {limit} bytes")
            out.append(chunk)
            if decomp.eof:
                rest = decomp.unused_data
                if not rest:
                    break
                if is_gzip and rest[:2] == b"\x1f\x8b":  # the next gzip member
                    data, decomp = rest, zlib.decompressobj(wbits)
                    continue
                raise InvalidArgument(f"{len(rest)} bytes of garbage follow the compressed request body")
            # Not at the end: either output was capped (input left over) or
            # the input ran out mid-stream.
            data = decomp.unconsumed_tail
            if not data:
                raise InvalidArgument(f"the {encoding} request body is truncated")
    except zlib.error as exc:
        raise InvalidArgument(f"the request body is not valid {encoding} data: {exc}") from None
    return b"".join(out)


def _has_zlib_header(body: Buffer) -> bool:
    head = bytes(memoryview(body)[:2])
    # Compression method 8 in the low nibble, and the header check bits.
    return len(head) == 2 and (head[0] & 0x0F) == 8 and ((head[0] << 8) | head[1]) % 31 == 0


def choose_encoding(accept_encoding: str) -> str:
    """The response coding for an Accept-Encoding header: gzip, deflate or identity.

    The highest q-value wins among the three, as Triton does; malformed
    entries are skipped.
    """
    best, best_q = "identity", 0.0
    for entry in accept_encoding.split(","):
        coding, _, params = entry.strip().partition(";")
        coding = coding.strip().lower()
        q = 1.0
        params = params.strip()
        if params.startswith("q="):
            try:
                q = float(params[2:])
            except ValueError:
                continue
        if coding in ("identity", "gzip", "deflate") and q > best_q:
            best, best_q = coding, q
    return best
