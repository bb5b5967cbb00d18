"""Run ``fedatoms`` (or materialize a dataset) under RLIMIT_DATA = what the warmed-up process uses + headroom.

``python limited.py HEADROOM_MB SERVER fedatoms ARGS…`` or ``python limited.py HEADROOM_MB SERVER materialize
MODULE:FN``. Before the limit is read off, the process does once what a client's fixed costs are: it
imports everything, opens a gRPC channel to SERVER (gRPC's thread pools) and trains the test's model on a few
generated samples (torch's lazy allocations). The limit counts heap and anonymous memory (Linux ≥ 4.7),
so from then on a process that copies more than the headroom into memory fails; one that streams does not.
"""

from __future__ import annotations

import importlib
import resource
import sys


def data_bytes() -> int:
    for line in open("/proc/self/status"):
        if line.startswith("VmData:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmData in /proc/self/status")


def main() -> int:
    headroom = int(sys.argv[1]) * 2**20
    import logging

    import grpc  # everything the client imports, before the limit is measured
    import torch
    import torchvision  # noqa: F401
    from big_data import Generated, StreamNet

    import client_agent.agent  # noqa: F401
    import fedatoms.cli
    from fedcore.training import TrainConfig, local_update

    logging.getLogger().addHandler(logging.NullHandler())
    with grpc.insecure_channel(sys.argv[2]) as channel:
        grpc.channel_ready_future(channel).result(timeout=60)
    model = StreamNet()
    local_update(model, Generated(400), TrainConfig(batch_size=100, device="cpu"), seed=0)
    del model
    limit = data_bytes() + headroom
    resource.setrlimit(resource.RLIMIT_DATA, (limit, limit))
    print(f"limit={limit} headroom={headroom}", flush=True)
    if sys.argv[3] == "materialize":
        module, _, name = sys.argv[4].partition(":")
        train, _ = getattr(importlib.import_module(module), name)()
        whole = torch.empty(len(train), *train[0][0].shape)  # what an in-memory copy needs
        for i in range(len(train)):
            whole[i] = train[i][0]
        print("materialized", flush=True)
        return 0
    import threading
    import time

    def report() -> None:  # the process's data size while it runs, for the test's record
        while True:
            print(f"vmdata={data_bytes()}", flush=True)
            time.sleep(1.0)

    threading.Thread(target=report, daemon=True).start()
    return fedatoms.cli.main(sys.argv[4:])


if __name__ == "__main__":
    sys.exit(main())
