"""How many engines run where: the reconcile pass and placement on the fleet, warm spares,
autoscaling.

Imports `controller.deploy`, `controller.fleet` and below.
"""
