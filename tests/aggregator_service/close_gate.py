"""A federation's strategy whose close waits for the test: FedAvg held in ``finish`` until :data:`RELEASE` is set.

Imported by reference (``strategy = "close_gate:GatedFedAvg"``) by an aggregator running in the test's
process, so the test decides how long a close takes and acts while it runs.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping

from torch import Tensor

from aggregator_service.strategies import FedAvg
from aggregator_service.strategies.base import RoundAccumulator
from aggregator_service.updates import AggregateResult

ENTERED = threading.Event()  # set once a close has reached finish
RELEASE = threading.Event()  # the close goes on once this is set


class GatedFedAvg(FedAvg):
    def finish(self, acc: RoundAccumulator, global_tensors: Mapping[str, Tensor]) -> AggregateResult:
        ENTERED.set()
        if not RELEASE.wait(60):
            raise TimeoutError("the test never released the close")
        return super().finish(acc, global_tensors)
