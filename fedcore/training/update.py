"""One client's round (:func:`local_update`): the SGD loop with the terms its method asks for.

Clients and the in-process simulator call this same function, so both transports compute
the same rounds.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Mapping

from torch import Tensor, nn

from fedcore.training.batchnorm import recompute_statistics
from fedcore.training.config import LocalResult, TrainConfig
from fedcore.training.ditto import check_personal_model, train_ditto
from fedcore.training.fedrep import head_parameters, train_head
from fedcore.training.loop import Batches, Dataset, resolve_device, seeded, sgd, training_only
from fedcore.training.nested import NestedCut
from fedcore.training.personal import atom_names, check_personal_atoms, train_personal
from fedcore.training.personalization import SPLITS
from fedcore.training.terms import LocalTerms, combine, frobenius_penalty, proximal_penalty

__all__ = ["local_update"]


def _cpu(t: Tensor) -> Tensor:
    """A detached CPU copy that shares no storage with the model (the model may train on)."""
    return t.detach().to("cpu", copy=True).contiguous()


def local_update(
    model: nn.Module,
    data: Dataset,
    config: TrainConfig,
    *,
    seed: int,
    terms: LocalTerms | None = None,
    server_control: Mapping[str, Tensor] | None = None,
    client_state: Mapping[str, Mapping[str, Tensor]] | None = None,
    personal_atoms: Mapping[str, Tensor] | None = None,
    personal_model: Mapping[str, Tensor] | None = None,
    on_epoch: Callable[[int, int], None] | None = None,
    nested: NestedCut | None = None,
    head: Collection[str] | None = None,
) -> LocalResult:
    """One client's round of local training; ``model`` is trained in place on the resolved device.

    ``terms`` are the strategy's client-side terms (:class:`~fedcore.training.terms.LocalTerms`;
    ``server_control`` alone means SCAFFOLD's): ``client_state`` holds the client's state
    groups from its previous rounds (zeros where absent) and ``LocalResult.strategy_state``
    the groups after this one. SCAFFOLD (option II) corrects every gradient by ``c − c_i`` and
    returns ``c_i⁺ = c_i − c + (w_start − w_end)/(K·lr)``, with ``K·lr`` the steps' total weight
    under momentum (:func:`~fedcore.training.terms.step_weight`). With ``personal_atoms`` the
    client's atoms are first trained on a frozen copy of the received model (see
    :func:`~fedcore.training.personal.train_personal_atoms`); the global update that follows
    is unaffected by it. With ``config.personalization == "ditto"`` the client's ``personal_model``
    ``v_k`` is trained first in the same way (:func:`~fedcore.training.ditto.train_ditto`) and returned
    as ``personal_model``; with ``"fedrep"`` the head is trained first
    (:func:`~fedcore.training.fedrep.train_head`) and then only the body. The other baselines train
    the model as it is given (the caller loads the client's personal tensors into it). With
    ``config.bn_statistics == "precise"`` the model's BatchNorm statistics are then recomputed for
    its trained weights (:mod:`~fedcore.training.batchnorm`). ``nested`` (a client above its mixed-tier
    federation's smallest tier) trains the smallest tier's part of the model as that model
    (:mod:`~fedcore.training.nested`); the personal phases train as they are. ``head`` names the head's
    parameters where the federation names its head (FedRep's split); else the last Linear is the head.
    """
    began = time.perf_counter()
    device = resolve_device(config.device)
    method = config.personalization
    if personal_atoms is not None:
        if method != "none":
            raise ValueError(f"personal atoms are a personalization of their own; not with {method!r}")
        check_personal_atoms(model, personal_atoms)
    if (personal_model is not None) != (method == "ditto"):
        raise ValueError("Ditto needs the client's personal model, and only Ditto takes one")
    if personal_model is not None:
        check_personal_model(model, personal_model)
    model.to(device)
    was_training = model.training
    params = {name: p for name, p in model.named_parameters() if p.requires_grad}
    if not params:
        raise ValueError("model has no trainable parameters")

    batches = Batches(data, device)
    if terms is None:
        terms = LocalTerms(control=server_control is not None)
    plan = terms.begin(params, server_control, client_state, device)
    if plan is not None and method in SPLITS:
        raise ValueError(
            f"the strategy's client state (SCAFFOLD's control variates, FedDyn's or FedDC's terms) spans "
            f"the whole model; it does not compose with {method!r}"
        )

    metrics: dict[str, float] = {}
    new_personal: dict[str, Tensor] | None = None
    if personal_atoms is not None:
        personal, metrics = train_personal(model, batches, config, personal_atoms, seed, device)
        state = personal.state_dict()
        new_personal = {name: _cpu(state[name]) for name in atom_names(personal)}
        del personal
    new_model: dict[str, Tensor] | None = None
    if personal_model is not None:
        ditto, ditto_metrics = train_ditto(model, batches, config, personal_model, seed)
        metrics.update(ditto_metrics)
        new_model = {k: _cpu(v) for k, v in ditto.state_dict().items()}
        del ditto
    if method == "fedrep":
        head = list(head) if head is not None else head_parameters(model)
        metrics.update(train_head(model, batches, config, seed, head))
        params = {n: p for n, p in params.items() if n not in set(head)}

    if plan is not None:
        start = plan.start
    else:
        start = {n: p.detach().clone() for n, p in params.items()} if config.prox_mu > 0 else {}
    penalty = combine(
        proximal_penalty(params, start, config.prox_mu) if config.prox_mu > 0 else None,
        proximal_penalty(params, start, plan.alpha) if plan is not None and plan.alpha > 0 else None,
        frobenius_penalty(model, config.frobenius_decay) if config.frobenius_decay > 0 else None,
    )
    correction = plan.correction if plan is not None else None
    model.train()
    try:
        with training_only(model, params), seeded(seed, device):
            stats = sgd(
                model, params, batches, config, config.local_epochs, seed, penalty, correction, on_epoch, nested
            )
    finally:
        model.train(was_training)

    if config.bn_statistics == "precise":
        with seeded(seed, device):
            recomputed = recompute_statistics(model, batches, config.batch_size, seed)
        if recomputed:
            metrics["bn_samples"] = float(recomputed)

    strategy_state = control_delta = None
    if plan is not None:
        after, delta = plan.finish(params, stats.steps, config.lr, config.momentum)
        strategy_state = {g: {n: _cpu(t) for n, t in group.items()} for g, group in after.items()}
        control_delta = None if delta is None else {n: _cpu(t) for n, t in delta.items()}

    metrics.update(
        train_loss=stats.loss,
        train_accuracy=stats.accuracy,
        steps=float(stats.steps),
        seconds=time.perf_counter() - began,
    )
    return LocalResult(
        tensors={k: _cpu(v) for k, v in model.state_dict().items()},
        num_samples=batches.n,
        metrics=metrics,
        strategy_state=strategy_state,
        control_delta=control_delta,
        personal_atoms=new_personal,
        personal_model=new_model,
    )
