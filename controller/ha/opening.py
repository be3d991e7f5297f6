"""Opening an HA controller (`--store etcd://...`): the etcd client, the election, the store and
the switcher, reading the shared state as a standby before the gRPC server starts."""

from __future__ import annotations

import logging
import socket
from collections.abc import Callable

from tenacity import AsyncRetrying, retry_if_exception_type, stop_after_delay, wait_exponential

from controller.config import ControllerConfig
from controller.core import Controller
from controller.engines.node_client import GrpcNodeClient
from controller.ha.election import LeaderElection
from controller.ha.fenced_node_client import LeaderOnlyNodeClient
from controller.ha.high_availability import HighAvailability
from controller.ha.leader_watch import LeaderDeathWatch
from controller.model.events import EventBus
from controller.store.etcd import EtcdStore
from controller.store.etcd_client import UNAVAILABLE_ERRORS, EtcdTarget, connect, parse_etcd_url, unreachable_hint
from motor.errors import ConfigError
from motor.service.grpc_server import aio_channel

logger = logging.getLogger(__name__)


def advertised_address(config: ControllerConfig, port: int) -> str:
    if config.advertise:
        return config.advertise
    host = config.listen.rsplit(":", 1)[0]
    return f"{socket.gethostname() if host in ('0.0.0.0', '::', '[::]') else host}:{port}"


async def open_high_availability(
    config: ControllerConfig, on_lead: Callable[[Controller], None] | None = None
) -> HighAvailability:
    """The etcd client, election, store and switcher for `--store etcd://...`, serving as a standby."""
    assert config.store
    endpoints, prefix = parse_etcd_url(config.store)
    target = EtcdTarget(
        endpoints,
        prefix,
        config.etcd_ca,
        config.etcd_cert,
        config.etcd_key,
        config.etcd_timeout,
        config.etcd_server_name,
    )
    client = connect(target)
    election = LeaderElection(client, prefix, address="", ttl=config.lease_ttl, renew_client=lambda: connect(target))
    store = EtcdStore(client, prefix, fence=election.fence)
    events = EventBus()

    def make_controller() -> Controller:
        node_client = GrpcNodeClient(tls=config.client_tls(), epoch=lambda: election.epoch)
        return Controller(
            config,
            store,
            LeaderOnlyNodeClient(node_client, election, store, config.commit_timeout),
            events=events,
            acting=election.is_leader,
        )

    death_watch = LeaderDeathWatch(election, lambda address: aio_channel(address, config.client_tls()))
    ha = HighAvailability(
        election, store, make_controller, events, target.describe(), config.commit_timeout, on_lead, death_watch
    )
    try:

        def waiting(state) -> None:
            logger.warning(
                "etcd at %s not readable yet (%s); %s",
                target.describe(),
                state.outcome.exception(),
                unreachable_hint(target),
            )

        async for attempt in AsyncRetrying(
            stop=stop_after_delay(config.etcd_startup_wait),
            wait=wait_exponential(max=2),
            retry=retry_if_exception_type(UNAVAILABLE_ERRORS),
            reraise=True,
            before_sleep=waiting,
        ):
            with attempt:
                await ha.open()
    except UNAVAILABLE_ERRORS as exc:
        await client.close()
        raise ConfigError(
            f"--store: cannot read the state from {target.describe()} within {config.etcd_startup_wait:g}s "
            f"({exc}); {unreachable_hint(target)}"
        ) from None
    return ha
