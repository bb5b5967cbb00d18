"""`fedatoms plot`: one figure comparing simulation runs, because curves read better than tables.

Panels: global (personalized, and cut to each tier below 1) test accuracy per round, cumulative bytes against the
FedAvg-equivalent, the clients' spread within each round, and the per-tensor aggregation intervals of the first run
whose intervals change. Runs a short label would name alike are told apart by the config keys where they differ.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["plot_accuracy_vs_bytes", "plot_runs", "run_label", "run_labels"]

#: line styles of the cuts to each tier below 1, in the run's colour (dashed is the personalized line)
CUT_STYLES = ("-.", (0, (3, 1, 1, 1, 1, 1)), (0, (1, 1)))


#: config keys that say where or how a run was executed, not what it computed: never what tells runs apart
_EXECUTION_KEYS = frozenset({"output", "threads", "engine", "transport", "ray_address", "ray_num_cpus", "device"})


def run_label(results: dict[str, Any], fallback: str) -> str:
    c = results.get("config", {})
    parts = [c.get("factorization", "?"), c.get("interval_policy", "?")]
    if c.get("strategy", "fedavg") != "fedavg":
        parts.insert(0, c["strategy"])
    if c.get("personalization", "none") != "none":
        parts.append(c["personalization"])
    if len(c.get("tiers", [1.0])) > 1:
        parts.append("tiers " + ",".join(f"{t:g}" for t in c["tiers"]))
    return " / ".join(parts) if c else fallback


def run_labels(runs: Sequence[tuple[Path, dict[str, Any]]]) -> list[str]:
    """One label per run, distinct where the runs are: runs that :func:`run_label` names alike get the config
    keys whose values tell them apart (``fp16=True``, ``seed=1``, ``strategy_args={…}``), else their file names."""
    labels = [run_label(res, path.stem) for path, res in runs]
    for label in set(labels):
        group = [i for i, other in enumerate(labels) if other == label]
        if len(group) < 2:
            continue
        configs = [runs[i][1].get("config", {}) for i in group]
        keys = sorted(
            k
            for k in set().union(*configs)
            if k not in _EXECUTION_KEYS and len({json.dumps(c.get(k), sort_keys=True) for c in configs}) > 1
        )
        said = [", ".join(f"{k}={json.dumps(c.get(k), sort_keys=True)}" for k in keys) for c in configs]
        for i, words in zip(group, said, strict=True):
            alike = said.count(words) > 1  # the same computation twice: the files tell them apart
            labels[i] = f"{label} ({', '.join(w for w in (words, runs[i][0].stem if alike else '') if w)})"
    return labels


def plot_runs(paths: Sequence[str | Path], output: str | Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [(Path(p), json.loads(Path(p).read_text())) for p in paths]
    if not runs:
        raise ValueError("give at least one results JSON")
    fig, axes = plt.subplots(2, 2, figsize=(13, 8.5), constrained_layout=True)
    ax_acc, ax_bytes, ax_disp, ax_int = axes.flat
    for (_path, res), label in zip(runs, run_labels(runs), strict=True):
        rounds = [r["round"] for r in res["rounds"]]
        (line,) = ax_acc.plot(rounds, [r["test_accuracy"] for r in res["rounds"]], label=f"{label}: global")
        tiers = res["rounds"][-1].get("tier_accuracy", {})  # the global model cut to each tier below 1
        for tier, style in zip(tiers, itertools.cycle(CUT_STYLES)):
            cut = [r.get("tier_accuracy", {}).get(tier) for r in res["rounds"]]
            ax_acc.plot(rounds, cut, linestyle=style, color=line.get_color(), label=f"{label}: cut to tier {tier}")
        personal = [r.get("personalized_accuracy") for r in res["rounds"]]
        if any(p is not None for p in personal):
            ax_acc.plot(rounds, personal, linestyle="--", color=line.get_color(), label=f"{label}: personalized")
        moved = [(r["cumulative_bytes_up"] + r["cumulative_bytes_down"]) / 1e6 for r in res["rounds"]]
        ax_bytes.plot(rounds, moved, color=line.get_color(), label=f"{label}: moved")
        ax_bytes.plot(
            rounds,
            [r["cumulative_fedavg_equivalent_bytes"] / 1e6 for r in res["rounds"]],
            color=line.get_color(),
            linestyle=":",
            label=f"{label}: FedAvg-equivalent",
        )
        ax_disp.plot(rounds, [r["dispersion"] for r in res["rounds"]], color=line.get_color(), label=label)
    ax_acc.set(title="test accuracy", xlabel="round", ylabel="accuracy", ylim=(0, 1))
    ax_bytes.set(title="cumulative bytes (down + up)", xlabel="round", ylabel="MB")
    ax_disp.set(
        title="client spread Σ p_k‖x_k − u‖²\n(within round, over the aggregated tensors)", xlabel="round", yscale="log"
    )
    from matplotlib.ticker import MaxNLocator

    for ax in (ax_acc, ax_bytes, ax_disp):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # rounds are whole numbers

    # the first run whose intervals change (a FedLAMA or fixed schedule), else the first
    shown = next((i for i, (_p, r) in enumerate(runs) if _intervals_vary(r)), 0)
    first = runs[shown][1]
    names = list(first["rounds"][0]["tensors"])
    grid = [[first["rounds"][i]["tensors"][n]["interval"] for i in range(len(first["rounds"]))] for n in names]
    # whole rounds from 1 up: a schedule that never relaxes reads as 1 on a 1–2 scale, not 0.9–1.1
    top = max(2, max(max(row) for row in grid)) if grid else 2
    image = ax_int.imshow(grid, aspect="auto", interpolation="nearest", cmap="viridis", vmin=1, vmax=top)
    ax_int.set(
        title=f"aggregation interval per tensor, set at each round's close\n({run_labels(runs)[shown]})",
        xlabel="round (the interval shown is in force from the next round)",
    )
    ax_int.set_yticks(range(len(names)), names, fontsize=6)
    ax_int.set_xticks(range(len(first["rounds"])), [str(r["round"]) for r in first["rounds"]], fontsize=6)
    bar = fig.colorbar(image, ax=ax_int, label="interval (rounds)")
    bar.locator = MaxNLocator(integer=True)  # intervals are whole rounds
    bar.update_ticks()
    output = Path(output)
    fig.savefig(output, dpi=110)
    plt.close(fig)
    return output


def _intervals_vary(results: dict[str, Any]) -> bool:
    return len({t["interval"] for r in results["rounds"] for t in r["tensors"].values()}) > 1


def plot_accuracy_vs_bytes(
    curves: dict[str, tuple[Sequence[float], Sequence[float]]],
    target: float | None,
    output: str | Path,
    title: str = "",
    cuts: dict[str, tuple[str, Sequence[float]]] | None = None,
) -> Path:
    """Test accuracy against cumulative bytes moved (down + up), one line per run: the papers' figure.

    ``curves`` maps a label to (cumulative bytes per round, accuracy per round); ``target`` draws
    the accuracy to reach as a horizontal line; ``cuts`` maps some labels to (tier, accuracy per
    round) of the global model cut to that tier, drawn dashed in the run's colour.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 5.5), constrained_layout=True)
    for label, (moved, accuracy) in curves.items():
        (line,) = ax.plot([b / 1e6 for b in moved], accuracy, marker=".", markersize=3, label=label)
        if cuts and label in cuts:
            tier, cut = cuts[label]
            ax.plot(
                [b / 1e6 for b in moved], cut, linestyle="--", color=line.get_color(), label=f"{label}: cut to {tier}"
            )
    if target is not None:
        ax.axhline(target, color="black", linestyle=":", linewidth=1, label=f"target {target:.3f}")
    ax.set(title=title or "accuracy against bytes", xlabel="cumulative bytes moved (MB, down + up)")
    ax.set(ylabel="test accuracy (server test set)", xscale="log", ylim=(0, 1))
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    output = Path(output)
    fig.savefig(output, dpi=110)
    plt.close(fig)
    return output
