"""The node managers: registration and heartbeats, who may hold a node id (claims), SUSPECT /
LOST and the silent-nodes alarm (liveness), the heartbeat rate budget and pacing, the fleet's
aggregate series.

Imports `controller.routing`, `controller.engines` and below.
"""
