"""The open-file limit of a service that holds a connection per peer (the controller: one per node)."""

from __future__ import annotations

import logging
import resource

logger = logging.getLogger(__name__)

# Linux's default ceiling on a process's open files (fs.nr_open): the target when the hard limit
# is unlimited.
NR_OPEN_DEFAULT = 1 << 20


def raise_open_files_limit() -> int:
    """Raise the soft limit on open files to the hard one, as Go's runtime does for its programs,
    and return the limit in force. The usual soft limit, 1,024, stopped a controller accepting
    nodes past about a thousand connections while gRPC only logged 'File descriptor limit
    reached. Retrying.'; the hard limit is the operator's (systemd LimitNOFILE=, docker --ulimit)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = NR_OPEN_DEFAULT if hard == resource.RLIM_INFINITY else hard
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (ValueError, OSError) as exc:
            logger.warning("open files: cannot raise the soft limit %d to %d (%s)", soft, target, exc)
            return soft
        logger.info("open files: soft limit raised from %d to %d, the hard limit", soft, target)
        return target
    return soft
