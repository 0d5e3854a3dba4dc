"""A generation's token ids on the wire: the one place the generation backend
writes them and the gateway reads them, so a generation can go on elsewhere.

- ``token_ids``, a request parameter (true) that asks for them, and then a
  response parameter: the ids of the tokens whose text a streamed response
  completes (usually one; none on the final response), as a JSON list. The
  ids of every response received, in order, are the tokens of the text
  received. Asked only where they are read: a stream pays nothing for them
  otherwise.
- ``resume_token_ids``, a request parameter: ids a generation already sent
  (a JSON list, or a list where parameters are JSON), to continue after
  them: prefilled after the prompt, counted toward ``max_tokens`` and the
  usage, their text not sent again (``execution.backends.generate``).
- ``resume_text`` and ``resume_tokens``, request parameters: the text a
  generation already sent and how many tokens it was, for a replica that
  takes no ids (an OpenAI-protocol server continues after the text) or
  when no ids were named (a stream begun on such a server, which names
  none: the generation backend tokenizes the text as its ids).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence

TOKEN_IDS = "token_ids"
RESUME_TOKEN_IDS = "resume_token_ids"
RESUME_TEXT = "resume_text"
RESUME_TOKENS = "resume_tokens"


def ids_text(ids: Sequence[int]) -> str:
    """Ids as a JSON list, written once per token: no encoder."""
    return f"[{ids[0]}]" if len(ids) == 1 else "[" + ",".join(map(str, ids)) + "]"


def join_texts(texts: Iterable[str]) -> str:
    """Several ``token_ids`` values as one JSON list of all their ids, in order (no parse)."""
    inner = ",".join(t[1:-1] for t in texts if len(t) > 2)
    return f"[{inner}]"


def parse_ids(value: object) -> list[int]:
    """A ``resume_token_ids`` value (a JSON list text, or a list) as ids; ``ValueError`` for anything else."""
    if isinstance(value, str):
        value = json.loads(value)
    if not isinstance(value, (list, tuple)) or not all(type(t) is int for t in value):
        raise ValueError("not a list of token ids")
    return list(value)
