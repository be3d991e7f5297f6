"""The probe of Motor's gRPC services: grpc.health.v1 Check of one service, over mutual TLS with
the pod's own certificate. Kubernetes' built-in gRPC probe speaks plaintext only, and every
Motor port requires a client certificate, so the pods run this instead (exit 0: SERVING).

    python health_probe.py ADDRESS SERVICE TLS_DIR [SERVER_NAME]

ADDRESS may name environment variables ($NODE_IP:50052). TLS_DIR holds tls.crt, tls.key and
ca.crt. SERVER_NAME: the name the server's certificate is checked against, when ADDRESS is not
one of its names (a controller probed on 127.0.0.1 as motor-controller).
"""

import os
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def main(argv: list[str]) -> int:
    if len(argv) not in (3, 4):
        print(__doc__, file=sys.stderr)
        return 2
    address, service, tls_dir = os.path.expandvars(argv[0]), argv[1], argv[2]

    def read(name: str) -> bytes:
        with open(os.path.join(tls_dir, name), "rb") as handle:
            return handle.read()

    credentials = grpc.ssl_channel_credentials(read("ca.crt"), read("tls.key"), read("tls.crt"))
    options = [("grpc.ssl_target_name_override", argv[3])] if len(argv) == 4 else []
    with grpc.secure_channel(address, credentials, options=options) as channel:
        try:
            answer = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=3
            )
        except grpc.RpcError as exc:
            print(f"{address} {service}: {exc.code().name} {exc.details()}", file=sys.stderr)
            return 1
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(answer.status)
    print(f"{address} {service}: {status}")
    return 0 if answer.status == health_pb2.HealthCheckResponse.SERVING else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
