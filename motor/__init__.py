"""Motor's common package: the generated motor.v1 API and what every service shares.

Shared here and nowhere else: gRPC server set-up (health, reflection, TLS, error mapping),
security, configuration loading with field-naming errors (cli_config), logging set-up, the id
rule and enum names, the user_config models, restart-policy defaults, the stream fan-out, task
set, stop signals, protobuf time helpers, the exit text, ports, process supervision helpers and
the deployment-file loader (docs/shared-rules.md).
"""

__version__ = "0.1.0"
