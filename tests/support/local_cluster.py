"""`motorctl up`'s LocalCluster in a fixture: started, yielded, then stopped leaving nothing behind."""

from __future__ import annotations

from collections.abc import Iterator

from motorctl.local_cluster import LocalCluster


def started(local: LocalCluster, timeout: float = 60.0) -> Iterator[LocalCluster]:
    """A fixture's body (`yield from started(local)`): the cluster started and yielded; then stopped,
    asserting that nothing had to be killed and nothing was left over."""
    try:
        local.start(timeout=timeout)
        yield local
    finally:
        problems = local.stop()
        assert not problems, problems
