"""`motorctl up`'s LocalCluster in a fixture: started, yielded, then stopped leaving nothing behind."""

from __future__ import annotations

import os
from collections.abc import Iterator

from motorctl.local_cluster import LocalCluster
from tests.support import REPO_ROOT


def started(local: LocalCluster, timeout: float = 60.0) -> Iterator[LocalCluster]:
    """A fixture's body (`yield from started(local)`): the cluster started and yielded; then stopped,
    asserting that nothing had to be killed and nothing was left over."""
    try:
        local.start(timeout=timeout)
        yield local
    finally:
        problems = local.stop()
        assert not problems, problems


EXAMPLE_DEPLOYMENT = os.path.join(REPO_ROOT, "examples", "local-deployment.yaml")


def example_cluster(tmp_path_factory, name: str, **options) -> LocalCluster:
    """Two nodes running the example deployment, heartbeats every 0.5 s, in a new directory named
    after `name` (not started); `options` for the rest of LocalCluster."""
    return LocalCluster(
        str(tmp_path_factory.mktemp(name)),
        nodes=2,
        heartbeat_interval=0.5,
        deployment_path=EXAMPLE_DEPLOYMENT,
        **options,
    )
