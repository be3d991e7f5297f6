"""The deployment's restart policy with its defaults, in seconds: the one place they are written.

The controller fills unset RestartPolicy fields from `Policy()` when it validates a deployment,
and restarts instances by `Policy.from_proto` of the result."""

from __future__ import annotations

from dataclasses import dataclass

from motor.contract import pbtime
from motor.v1 import controller_pb2

# RestartPolicy's google.protobuf.Duration fields.
DURATION_FIELDS = ("initial_backoff", "max_backoff", "reset_after", "failure_window")


@dataclass(frozen=True)
class Policy:
    """RestartPolicy with defaults applied, in seconds."""

    group_scope: bool = True
    # First restart is immediate; then initial_backoff, doubling up to max_backoff.
    initial_backoff: float = 1.0
    max_backoff: float = 60.0
    # Healthy (READY) this long: the backoff starts over.
    reset_after: float = 600.0
    # This many failures within failure_window: the instance is FAILED (crash loop).
    max_failures: int = 5
    failure_window: float = 600.0

    @classmethod
    def from_proto(cls, p: controller_pb2.RestartPolicy) -> Policy:
        """Unset (zero) fields take the defaults."""
        default = cls()
        durations = {name: pbtime.seconds(getattr(p, name)) or getattr(default, name) for name in DURATION_FIELDS}
        return cls(
            group_scope=p.scope != controller_pb2.RESTART_SCOPE_RANK,
            max_failures=p.max_failures or default.max_failures,
            **durations,
        )


def fill_defaults(p: controller_pb2.RestartPolicy) -> None:
    """Set every unset field of `p` to its default (in place)."""
    default = Policy()
    if p.scope == controller_pb2.RESTART_SCOPE_UNSPECIFIED:
        p.scope = controller_pb2.RESTART_SCOPE_GROUP
    for name in DURATION_FIELDS:
        if not p.HasField(name):
            getattr(p, name).CopyFrom(pbtime.duration(getattr(default, name)))
    if p.max_failures == 0:
        p.max_failures = default.max_failures
