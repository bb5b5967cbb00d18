"""The personalization baselines the decomposition paper compares personal atoms with, by name.

Each is a switch on the client (``TrainConfig.personalization``); the methods differ in what
stays on the device and how the client's personal model is trained and evaluated:

========  ==========================================================  ======================
name      method (paper)                                              never leaves a client
========  ==========================================================  ======================
none      the global model only                                       —
ft        FedAvg+FT / FedProx+FT: the received global model fine-     —
          tuned locally for ``personal_epochs`` before evaluation
fedper    FedPer (Arivazhagan et al. 2019): personal head, body       the head
          averaged
fedrep    FedRep (Collins et al. 2021): personal head trained          the head
          ``head_epochs`` with the body frozen, then the body
          ``local_epochs`` with the head frozen; body averaged
lg        LG-FedAvg (Liang et al. 2020): personal body (local          the body
          representation), global head averaged
ditto     Ditto (Li et al. 2021): a personal model ``v_k`` trained    ``v_k`` (a copy beside
          with loss + λ/2‖v_k − w‖²; the global update is FedAvg      the global model)
local     Local-only: every client trains its own model from round     everything
          0's, never averaged
========  ==========================================================  ======================

The *head* is the model's last Linear, named ``head`` in every model of the zoo (its tensors
have role ``head`` in the :class:`~fedcore.spec.ModelSpec`); the *body* is everything else,
BN statistics included. Server and client call :func:`personal_tensors` on the same spec, so
both agree on what is never aggregated and never travels. A split that would put one tied parameter
(``head.weight = embed.weight``) both in the personal and in the averaged part is refused by name: the
averaged copy would overwrite the personal one every round.
"""

from __future__ import annotations

from functools import cache

from fedcore.convert import tied_parameters
from fedcore.spec import ModelSpec, _meta_module

__all__ = ["PERSONALIZATIONS", "SPLITS", "personal_tensors"]

#: Every ``TrainConfig.personalization`` value.
PERSONALIZATIONS = ("none", "ft", "fedper", "fedrep", "lg", "ditto", "local")
#: The methods that split the model: their personal tensors replace the global ones on the client
#: (the server never aggregates them). Ditto keeps a whole personal copy *beside* the global model.
SPLITS = ("fedper", "fedrep", "lg", "local")


def personal_tensors(spec: ModelSpec, method: str) -> tuple[str, ...]:
    """Names of ``spec``'s tensors (any tier) that ``method`` keeps on the client instead of the global ones.

    Empty for ``none``, ``ft`` and ``ditto`` (the server aggregates the whole model). A split of a
    model with no head is refused: FedPer, FedRep and LG-FedAvg cut at the head (the last Linear, or the
    federation's ``head``).
    """
    if method not in PERSONALIZATIONS:
        raise ValueError(f"unknown personalization {method!r}; choose one of {', '.join(PERSONALIZATIONS)}")
    if method not in SPLITS:
        return ()
    if method == "local":
        return tuple(spec.names)
    head = tuple(t.name for t in spec.tensors if t.role == "head")
    if not head:
        raise ValueError(
            f"personalization {method!r} splits the model at its head (its last nn.Linear, or the module "
            f"[federation] head names); {spec.describe()} has no nn.Linear: name its head"
        )
    personal = head if method in ("fedper", "fedrep") else tuple(t.name for t in spec.tensors if t.role != "head")
    _refuse_split_ties(spec, method, personal)
    return personal


@cache
def _tied_names(spec: ModelSpec) -> tuple[tuple[str, ...], ...]:
    """The names of each parameter the model holds under more than one name (tied weights, a reused module)."""
    tied = tied_parameters(_meta_module(spec))
    return tuple(tuple(dict.fromkeys(names)) for names in tied if len(set(names)) > 1)


def _refuse_split_ties(spec: ModelSpec, method: str, personal: tuple[str, ...]) -> None:
    kept = set(personal)
    for names in _tied_names(spec):
        mine = [n for n in names if n in kept]
        shared = [n for n in names if n not in kept and n in spec.names]
        if mine and shared:
            raise ValueError(
                f"personalization {method!r} keeps {', '.join(mine)} on each client, but it is one tied parameter "
                f"with {', '.join(shared)}, which is averaged every round: the personal part would not be personal; "
                "untie them in the model, or use a personalization that keeps both or neither (ft, ditto, local)"
            )
