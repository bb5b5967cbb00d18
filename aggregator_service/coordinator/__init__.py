"""The durable round lifecycle behind the gRPC service: plain Python, no transport.

:class:`Coordinator` is a thin façade over rooms, one job each: :mod:`.registry` (enrollment,
tokens, last seen), :mod:`.tasks` (GetTask, opening rounds, FetchModel), :mod:`.uploads`
(PushUpdate, late pushes), :mod:`.closing` (closes, metrics, deadlines), :mod:`.ledger`
(bytes moved), :mod:`.evaluations`; :mod:`.shared` holds what they share and :mod:`.restore`
rebuilds it from the store, so a restarted aggregator continues the open round where it stood.
Every state change becomes visible to clients only after its transaction committed. Rounds are
computed exactly as the in-process simulator computes them: the same plan, updates folded in
client order, each client's task seeded with ``derive_seed(seed, round, client key)``.
"""

from aggregator_service.logfmt import kv

from .answers import ClientInfo, Done, PushResult, Registration, Train, Wait
from .facade import Coordinator
from .ledger import ModelFetch
from .shared import OpenRound

__all__ = [
    "ClientInfo",
    "Coordinator",
    "Done",
    "ModelFetch",
    "OpenRound",
    "PushResult",
    "Registration",
    "Train",
    "Wait",
    "kv",
]
