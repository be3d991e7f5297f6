"""Motor's common package: the generated motor.v1 API and what every service shares.

Shared here and nowhere else: gRPC server set-up (health, reflection, TLS, error mapping),
configuration loading with field-naming errors, logging set-up, ids and enum names, ports,
process supervision helpers and the deployment-file loader.
"""

__version__ = "0.1.0"
