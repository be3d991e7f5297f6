"""The controller's tables and what they announce: nodes, engine slots, instances (with their
state machine), deployments with their revisions and rollout records, events; `ClusterState`
holds them and the rules every part shares when it changes them.

Imports `controller.store` (each change is written first) and `controller.rules`.
"""
