"""The gateway's core: the request path and the answers behind both frontends.

- ``gateway``: ``Gateway``, what the frontends call (``gateway.types.InferenceCore``):
  start and stop, health, metadata, statistics, repository control;
- ``pipeline``: the request path, one named step after another (admit,
  resolve, validate, cache, batch, route, split back, classify); its
  docstring walks one request through the whole gateway;
- ``models``: which model and version a request means;
- ``parts``: the settings the core reads (``CoreSettings``) and the seams
  where several gateway processes differ from one.

The core builds none of its parts: ``gateway.composition`` does, from the
config, and hands each core part the few parts it calls. May import every gateway package below it (all but
``composition``, ``app`` and ``up``); the frontends and the observers never
import it, they are handed the gateway through a ``Protocol``.
"""

from gateway.core.gateway import Gateway
from gateway.core.parts import CoreSettings, LocalModelControl, LocalStatistics, ModelControl, StatisticsScope

__all__ = ["CoreSettings", "Gateway", "LocalModelControl", "LocalStatistics", "ModelControl", "StatisticsScope"]
