"""A process that campaigns and, while it leads, writes a tick through the fenced etcd store
every 50 ms; it reports each role change and write outcome as a JSON line on stdout.
Used by test_election.py to SIGSTOP/SIGCONT a real leader process.

    python -m tests.ha.elector ENDPOINT PREFIX NAME TTL
"""

from __future__ import annotations

import asyncio
import json
import sys
import time

from controller.ha.election import LeaderElection
from controller.store.etcd import EtcdStore, Fenced
from controller.store.etcd_client import EtcdTarget, connect


def report(**fields) -> None:
    print(json.dumps({"t": time.time(), **fields}), flush=True)


async def main(endpoint: str, prefix: str, name: str, ttl: int) -> None:
    host, port = endpoint.rsplit(":", 1)
    target = EtcdTarget(((host, int(port)),), prefix, request_timeout=1.0)
    client = connect(target)
    election = LeaderElection(client, prefix, address=name, ttl=ttl, renew_client=lambda: connect(target))
    election.on_change(
        lambda role, leader, reason: report(role=role.value, epoch=leader.epoch if leader else 0, reason=reason)
    )
    store = EtcdStore(client, prefix, fence=election.fence)
    await store.open()
    election.start()
    ticks, epoch = 0, 0
    while True:
        if not election.is_leader():
            await asyncio.sleep(0.02)
            continue
        if election.epoch != epoch:  # a new leadership starts from what etcd holds
            epoch = election.epoch
            await store.reload()
        ticks += 1
        store.save_instance(f"tick-{name}", {"n": ticks, "epoch": epoch})
        try:
            await store.flush()
            report(write="ok", n=ticks, epoch=epoch)
        except Fenced as exc:
            report(write="refused", n=ticks, epoch=epoch, reason=str(exc))
            election.lost(f"a write was refused: {exc}")
        await asyncio.sleep(0.05)


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])))
