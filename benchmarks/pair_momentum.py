"""What momentum's restart costs a low-rank factor pair: one epoch of central SGD, restarted or not.

The digits CNN, plain and as FedHM at tier ⅛ (factors cut from the same initial model, the
federation's first cut), trained on the whole digits train split for one epoch (batch 10, lr 0.01,
momentum 0.9) with a fresh optimizer every ``--restart`` steps (14: a digits client's round of
E = 2 epochs over about 70 samples) or never; the test loss after the epoch is printed. A third
row debiases the pairs' momentum (their rate ``lr / (1 − β^k)`` at the ``k``-th step since the
restart), the rule docs/methods.md reports as tried and not shipped ("What momentum's restart
costs a factor pair").

    OMP_NUM_THREADS=1 python benchmarks/pair_momentum.py [--restart 14] [--atom-lr scaled]
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from fedatoms.simulate import SimulationConfig
from fedcore.data import load_dataset
from fedcore.training.atom_steps import ATOM_LR_RULES, AtomSteps


def test_loss(tier: float, restart: int | None, debias: bool, rule: str, lr: float, seed: int) -> float:
    """The test loss after one epoch of the model at ``tier`` (1: plain), restarting SGD every ``restart`` steps."""
    factorization = "none" if tier == 1.0 else "lowrank"
    federation = SimulationConfig(dataset="digits", factorization=factorization, tiers=[tier], seed=seed)
    federation = federation.build_federation(num_clients_total=1)
    model = federation.tier_spec(tier).build()
    model.load_state_dict(federation.tier_tensors(tier))
    train, test = load_dataset("digits")
    x, y = torch.as_tensor(train.x), torch.as_tensor(train.y)
    params = dict(model.named_parameters())
    pairs = {id(p) for n, p in params.items() if "lowrank_" in n}

    def fresh() -> tuple[AtomSteps, torch.optim.SGD]:
        steps = AtomSteps(model, params, lr, rule)
        return steps, torch.optim.SGD(steps.param_groups, lr=lr, momentum=0.9)

    steps, optimizer = fresh()
    since = 0
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))
    for i in range(0, len(y) - 9, 10):
        batch = order[i : i + 10]
        optimizer.zero_grad()
        F.cross_entropy(model(x[batch]), y[batch]).backward()
        steps.rescale(optimizer)
        since += 1
        if debias:
            for group in optimizer.param_groups:
                if any(id(p) in pairs for p in group["params"]):
                    group["lr"] /= 1.0 - 0.9**since
        optimizer.step()
        if restart is not None and since == restart:
            steps, optimizer = fresh()
            since = 0
    with torch.no_grad():
        return float(F.cross_entropy(model(torch.as_tensor(test.x)), torch.as_tensor(test.y)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--restart", type=int, default=14, help="steps between restarts of SGD [14]")
    parser.add_argument("--atom-lr", default="scaled", choices=ATOM_LR_RULES)
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rows = [("plain model", 1.0, False), ("FedHM at 1/8", 0.125, False), ("FedHM at 1/8, debiased pairs", 0.125, True)]
    print(f"digits, one epoch, batch 10, lr {args.lr:g}, momentum 0.9, atom_lr = {args.atom_lr}: test loss")
    print(f"{'':32}{'kept':>10}{f'restarted every {args.restart}':>26}")
    for name, tier, debias in rows:
        kept = test_loss(tier, None, debias, args.atom_lr, args.lr, args.seed)
        restarted = test_loss(tier, args.restart, debias, args.atom_lr, args.lr, args.seed)
        print(f"{name:32}{kept:>10.3f}{restarted:>26.3f}", flush=True)


if __name__ == "__main__":
    main()
