"""Motor's common package: the generated motor.v1 API and what every service shares, by concern.

- `motor.contract`: the rules the services agree on (ids, time, exits, start refusals, the
  user_config and deployment file, engine policy, heartbeat timing).
- `motor.service`: the plumbing every process runs on (gRPC servers, metrics, logs, signals,
  settings from flags and files, retries, stream fan-out, background tasks).
- `motor.security`: mutual TLS, identities and roles, tokens, the development PKI.
- at the top: errors, the clock, the state-machine table, ports, process supervision and the
  leader lookup that every service and motorctl use.

The index of every shared rule and where it lives: docs/shared-rules.md.
"""

__version__ = "0.1.0"
