"""A request's model version string, read as Triton reads it.

Triton turns the version a client names (the URL's ``/versions/N``, a gRPC
request's ``model_version``) into a number with C++ ``std::stol``: leading
blanks and a sign are allowed, the digits that follow are the number and
anything after them is ignored; no digits, or a number past int64, is
INVALID_ARGUMENT "failed to get model version from specified version
string ..."; a negative number is "invalid model version specified ...".
An empty string means the model's newest version.
"""

from __future__ import annotations

import re

from protos.errors import InvalidArgument

_INT64_MAX = 2**63 - 1
# What std::stol reads: leading whitespace, an optional sign, then digits.
_STOL = re.compile(r"[ \t\n\v\f\r]*([+-]?[0-9]+)")


def model_version(text: str) -> str:
    """``text`` as the version number it names ("" stays ""), or Triton's refusal."""
    if not text or text.isdigit() and text[0] != "0" and len(text) < 19:
        return text  # the usual case: already the number's own spelling
    match = _STOL.match(text)
    number = int(match.group(1)) if match else None
    if number is None or not -_INT64_MAX - 1 <= number <= _INT64_MAX:
        raise InvalidArgument(
            f"failed to get model version from specified version string '{text}' (details: stol), "
            "version should be an integral value > 0"
        )
    if number < 0:
        raise InvalidArgument(
            f"invalid model version specified '{text}' , version should be an integral value > 0"
        )
    return str(number)
