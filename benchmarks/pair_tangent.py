"""How much of the gradient a low-rank factor pair can follow: its tangent share, from the first cut on.

A rank-``r`` pair ``W = U V`` moves, under SGD or ScaledGD, only inside the tangent space of the
rank-``r`` matrices at ``W``: ``P_U G + G P_V − P_U G P_V`` of the plain layer's gradient ``G``
(docs/methods.md, "Why low-rank factor pairs are preconditioned"). Cut from a random layer, ``U`` and
``V`` span random subspaces and that share is about ``r/m + r/n``; it grows only as training turns
the subspaces toward the gradient. This script trains the digits CNN as FedHM at a tier (the
federation's first cut; batch 10, momentum 0.9, ``atom_lr = preconditioned``) on the whole digits
train split and prints, every ``--every`` steps, the test loss and, per factor pair, the share of
``‖G‖²`` on the first 600 training samples that lies in its tangent space. ``G`` is the gradient of
the plain model holding the same weights, computed independently of the factors.

    OMP_NUM_THREADS=1 python benchmarks/pair_tangent.py [--lr 0.01] [--tier 0.125] [--epochs 2]
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from fedatoms.simulate import SimulationConfig
from fedcore.data import load_dataset
from fedcore.layers import LowRankConv2d, LowRankLinear, conv_weight_to_matrix
from fedcore.training.atom_steps import AtomSteps


def _projector(basis: torch.Tensor) -> torch.Tensor:
    q, _ = torch.linalg.qr(basis)
    return q @ q.T


def tangent_shares(
    model: torch.nn.Module, plain: torch.nn.Module, x: torch.Tensor, y: torch.Tensor
) -> dict[str, float]:
    """Per factor pair of ``model``: ‖tangent part of G‖² / ‖G‖², G from ``plain`` holding the same weights."""
    pairs = {n: m for n, m in model.named_modules() if isinstance(m, (LowRankConv2d, LowRankLinear))}
    state = {k: v for k, v in model.state_dict().items() if ".lowrank_" not in k}
    factors = {}
    for name, m in pairs.items():
        factors[name] = (m.lowrank_u.detach(), m.lowrank_v.detach())
        state[f"{name}.weight"] = m.weight.detach()  # the filter the pair computes with
    plain.load_state_dict(state)
    plain.zero_grad()
    F.cross_entropy(plain(x), y).backward()
    shares = {}
    for name in pairs:
        grad = dict(plain.named_parameters())[f"{name}.weight"].grad
        g = conv_weight_to_matrix(grad) if grad.dim() == 4 else grad
        u, v = factors[name]
        pu, pv = _projector(u), _projector(v.T)
        tangent = pu @ g + g @ pv - pu @ g @ pv
        shares[name] = float(tangent.square().sum() / g.square().sum())
    return shares


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--tier", type=float, default=0.125)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--every", type=int, default=30, help="steps between reports [30]")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.manual_seed(args.seed)
    federation = SimulationConfig(dataset="digits", factorization="lowrank", tiers=[args.tier], seed=args.seed)
    federation = federation.build_federation(num_clients_total=1)
    model = federation.tier_spec(args.tier).build()
    model.load_state_dict(federation.tier_tensors(args.tier))
    plain_federation = SimulationConfig(dataset="digits", factorization="none", seed=args.seed)
    plain = plain_federation.build_federation(num_clients_total=1).tier_spec(1.0).build()
    train, test = load_dataset("digits")
    probe_x, probe_y = train.x[:600], train.y[:600]
    steps = AtomSteps(model, dict(model.named_parameters()), args.lr, "preconditioned")
    optimizer = torch.optim.SGD(steps.param_groups, lr=args.lr, momentum=0.9)

    def report(step: int) -> None:
        shares = tangent_shares(model, plain, probe_x, probe_y)
        with torch.no_grad():
            loss = float(F.cross_entropy(model(test.x), test.y))
        cells = "  ".join(f"{name} {share:.2f}" for name, share in shares.items())
        print(f"step {step:>4}  test loss {loss:.3f}  tangent share: {cells}", flush=True)

    print(f"digits CNN as FedHM at tier {args.tier:g}, lr {args.lr:g}, momentum 0.9, batch 10, preconditioned pairs")
    report(0)
    step = 0
    for _ in range(args.epochs):
        order = torch.randperm(len(train.y))
        for i in range(0, len(order) - 9, 10):
            batch = order[i : i + 10]
            optimizer.zero_grad()
            F.cross_entropy(model(train.x[batch]), train.y[batch]).backward()
            steps.rescale(optimizer)
            optimizer.step()
            step += 1
            if step % args.every == 0:
                report(step)


if __name__ == "__main__":
    main()
