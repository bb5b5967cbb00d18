"""The papers' variance (Prop. 5.1): the aggregated model's variance across repeated local trainings.

The same command as ``fedatoms analyze variance`` (:mod:`fedatoms.variance` computes it): from
``initial_model(seed)``, every client's local training is repeated N_c times with different data
orders, each repetition is aggregated by the federation's own code, and the per-layer variance of
the aggregated conv filters (``ᾱ × D̄`` for atoms) is printed for none and atoms, with the ratio.

    .venv/bin/python benchmarks/variance.py                      # digits, 10 clients × 2 classes, N_c = 10
    .venv/bin/python benchmarks/variance.py --atom-lr shared     # the papers' single learning rate
    .venv/bin/python benchmarks/variance.py --dataset mnist --data-dir DIR --clients 20
"""

from __future__ import annotations

import sys

from fedatoms.cli import main

if __name__ == "__main__":
    sys.exit(main(["analyze", "variance", *sys.argv[1:]]))
