"""Several controllers on one etcd: exactly one acts (docs/ha.md).

- `election.py`: the election and its fencing epoch.
- `high_availability.py`: `HighAvailability` runs a full `Controller` only while this process
  leads; on a standby, a read-only view of the store that the read RPCs answer from.
- `node_client.py`: `LeaderOnlyNodeClient`, node-manager commands only from the leader, after
  the store has written what they depend on, with the epoch on them.
- `leader_gate.py`: `LeaderGate`, the server's hook for mutating RPCs: on a standby they answer
  UNAVAILABLE naming the leader; on the leader a change is in etcd before the call returns.
- `leader_watch.py`: a standby's fast path when the leader's process is gone.
- `opening.py`: `open_high_availability`, all of the above for `--store etcd://...`.
"""
