"""The aggregator image's health probe: ``fedatoms-grpc-health live|ready``.

``live``: the gRPC health service answers ``Check`` at all (SERVING or NOT_SERVING): the process
is up and its server thread pool works, even while it shuts down gracefully (NOT_SERVING).
``ready``: ``Check`` answers SERVING (not shutting down; a paused federation is SERVING, as its
clients must still reach it to be told so): send clients to it.

Address from ``FEDATOMS_HEALTH_ADDR`` (default ``127.0.0.1:`` + the port of ``FEDATOMS_LISTEN``).
With ``FEDATOMS_TLS_CERT`` set the probe speaks TLS, trusting that certificate, and checks it for
the name in ``FEDATOMS_HEALTH_TLS_NAME`` (default ``localhost``). Exit 0 healthy, 1 not.
"""

import os
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def _address() -> str:
    if "FEDATOMS_HEALTH_ADDR" in os.environ:
        return os.environ["FEDATOMS_HEALTH_ADDR"]
    port = os.environ.get("FEDATOMS_LISTEN", "127.0.0.1:50051").rpartition(":")[2]
    return f"127.0.0.1:{port}"


def _channel(address: str) -> grpc.Channel:
    cert = os.environ.get("FEDATOMS_TLS_CERT")
    if not cert:
        return grpc.insecure_channel(address)
    with open(cert, "rb") as f:
        credentials = grpc.ssl_channel_credentials(root_certificates=f.read())
    name = os.environ.get("FEDATOMS_HEALTH_TLS_NAME", "localhost")
    return grpc.secure_channel(address, credentials, options=[("grpc.ssl_target_name_override", name)])


def main() -> int:
    mode = sys.argv[1] if len(sys.argv) > 1 else "live"
    if mode not in ("live", "ready"):
        print("usage: fedatoms-grpc-health live|ready", file=sys.stderr)
        return 2
    address = _address()
    with _channel(address) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
        except grpc.RpcError as exc:
            print(f"{address}: {exc.code().name}", file=sys.stderr)
            return 1
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    print(f"{address}: {status}")
    return 0 if mode == "live" or reply.status == health_pb2.HealthCheckResponse.SERVING else 1


if __name__ == "__main__":
    sys.exit(main())
