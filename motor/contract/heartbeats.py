"""Heartbeat timing both sides rely on: the node manager retries an unreachable controller at most
this far apart, and the controller allows for it when it judges a node's silence after a restart.
"""

# The longest a node manager waits between two tries to reach an unreachable controller: after a
# controller restart, a node's first report may come that long after the controller is back.
MAX_BACKOFF = 10.0
