"""A digits model whose forward ends its process on a Ray actor: a client that kills its worker every time it trains.

``tests.dying_model:build`` as ``--model``, run where this checkout is the working directory (as Ray's workers are);
the driver's own evaluation runs the plain forward.
"""

from __future__ import annotations

import os

from torch import Tensor, nn

from fedcore.models import digits_cnn


def build(num_classes: int = 10) -> nn.Module:
    net = digits_cnn(num_classes)
    forward = net.forward

    def dying(x: Tensor) -> Tensor:
        import ray

        if ray.is_initialized() and ray.get_runtime_context().get_actor_id() is not None:
            os._exit(1)
        return forward(x)

    net.forward = dying  # type: ignore[method-assign]
    return net
