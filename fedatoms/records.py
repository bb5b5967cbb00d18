"""The per-round record's shared fields and the run's summary, written alike by both transports.

The in-process simulator builds its records as it runs and the gRPC simulator reads them back
from the aggregator's database; both go through these helpers so that the same seed gives the
same record whichever transport ran it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, MutableMapping
from typing import Any

__all__ = ["CATEGORY_TOTALS", "TOTALS", "accumulate", "mean_or_none", "summarize"]

#: Bytes per transfer category (:data:`aggregator_service.metrics.CATEGORIES`): ``bytes_down`` is
#: ``bytes_train_fetch + bytes_eval_fetch``, ``bytes_up`` is ``bytes_push``.
CATEGORY_TOTALS = ("bytes_train_fetch", "bytes_eval_fetch", "bytes_push")
#: The per-round counts that a record also carries as ``cumulative_<key>`` over the run.
TOTALS = ("bytes_up", "bytes_down", "fedavg_equivalent_bytes", *CATEGORY_TOTALS)


def mean_or_none(values: list[float]) -> float | None:
    """The unweighted mean over the clients that evaluated (a round's cohort): each client counts once. FedRep's
    code weights by test-set size over all clients; the dashboard's mean_client_accuracy is sample-weighted."""
    return math.fsum(values) / len(values) if values else None


def accumulate(record: dict[str, Any], totals: MutableMapping[str, int]) -> None:
    """Add ``record``'s counts to the running ``totals`` and write them into it as ``cumulative_<key>``."""
    for key in TOTALS:
        totals[key] += record[key]
        record[f"cumulative_{key}"] = totals[key]


def summarize(records: list[dict[str, Any]], totals: Mapping[str, int], seconds: float) -> dict[str, Any]:
    """The run in one object: the last and best accuracies, and the bytes moved against FedAvg's."""
    last = records[-1]
    evaluated = [r["test_accuracy"] for r in records if r["test_accuracy"] is not None]
    last5 = [r["test_accuracy"] for r in records[-5:] if r["test_accuracy"] is not None]
    moved = totals["bytes_up"] + totals["bytes_down"]
    summary: dict[str, Any] = {
        "rounds": len(records),
        # None throughout when the server evaluates nothing (an aggregator without eval_data, --server)
        "final_test_accuracy": last["test_accuracy"],
        "best_test_accuracy": max(evaluated, default=None),
        # non-IID global accuracy swings round to round; the last rounds' mean compares runs fairly
        "mean_test_accuracy_last5": sum(last5) / len(last5) if last5 else None,
        "final_local_accuracy": last["local_accuracy"],
        "bytes_up": totals["bytes_up"],
        "bytes_down": totals["bytes_down"],
        "bytes_total": moved,
        **{key: totals[key] for key in CATEGORY_TOTALS},
        "fedavg_equivalent_bytes": totals["fedavg_equivalent_bytes"],
        "bytes_ratio_vs_fedavg": moved / totals["fedavg_equivalent_bytes"]
        if totals["fedavg_equivalent_bytes"]
        else None,
        "wall_seconds": round(seconds, 3),
    }
    if "tier_accuracy" in last:  # the global model cut to each tier below 1 (what those clients run)
        tail = [r["tier_accuracy"] for r in records[-5:] if "tier_accuracy" in r]
        summary["mean_tier_accuracy_last5"] = {
            t: math.fsum(c[t] for c in tail) / len(tail) for t in last["tier_accuracy"]
        }
    if "personalized_accuracy" in last:
        summary["final_personalized_accuracy"] = last["personalized_accuracy"]
        personal = [r["personalized_accuracy"] for r in records[-5:] if r["personalized_accuracy"] is not None]
        summary["mean_personalized_accuracy_last5"] = mean_or_none(personal)
    return summary
