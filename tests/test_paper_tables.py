"""``benchmarks/paper_tables.py`` in the paper's setting: its atoms and step rule reach the rows with atoms only."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _module():
    spec = importlib.util.spec_from_file_location("paper_tables", ROOT / "benchmarks" / "paper_tables.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["paper_tables"] = module
    spec.loader.exec_module(module)
    return module


def test_the_papers_atoms_and_single_rate_reach_the_rows_with_atoms_only() -> None:
    """The paper runs 9 atoms on every conv (LeNet's 5×5 ones too) at one learning rate: ``--num-atoms 9
    --atom-lr shared`` gives the "+ Decomposition" rows and personal atoms exactly that, the plain rows nothing."""
    tables = _module()
    parser_args = ["--dataset", "digits", "--num-atoms", "9", "--atom-lr", "shared"]
    args = tables.parse_args(parser_args)
    with_atoms = tables._config(args, 0, strategy="fedavg", factorization="atoms")
    assert (with_atoms.num_atoms, with_atoms.atom_lr) == (9, "shared")
    personal = tables._config(args, 0, **tables.PERSONAL_ROWS["Ours (personal atoms)"])
    assert (personal.num_atoms, personal.atom_lr) == (9, "shared")
    plain = tables._config(args, 0, strategy="fedavg", factorization="none")
    assert plain.num_atoms is None
    default = tables._config(tables.parse_args(["--dataset", "digits"]), 0, strategy="fedavg", factorization="atoms")
    assert (default.num_atoms, default.atom_lr) == (None, "preconditioned")
