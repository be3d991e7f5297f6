"""Deployments over time: applying and deleting them (persisted first, in slices), rollouts and
their plans, what "available" means, the model roots a deployment's paths must lie in.

Imports `controller.routing`, `controller.engines` and below.
"""
