"""What a node manager reports, checked before the controller reads it: engine counts within the
node's limit and the reported text fit for events, logs and addresses."""

from __future__ import annotations

from collections.abc import Collection, Iterator, Sequence

from motor.contract import names
from motor.errors import ResourceExhausted
from motor.v1 import types_pb2

# Engines one node may report: a node runs an engine per accelerator or so (plus old copies
# being stopped); thousands are a broken or hostile node manager, whose list would stall the loop.
MAX_ENGINES_PER_NODE = 1024


def check_engine_count(node_id: str, count: int, limit: int, where: str) -> None:
    """RESOURCE_EXHAUSTED naming the limit when a node reports more engines than one node may run."""
    if count > limit:
        raise ResourceExhausted(
            f"{where}: node {node_id} reports {count} engines; one node may report at most "
            f"max_engines_per_node={limit} (controller setting --max-engines-per-node)"
        )


# Text of a reported engine that reaches events, logs, addresses or command lines.
REPORTED_TEXT = ("node_id", "log_path")
REPORTED_SPEC_TEXT = ("instance_id", "host", "master_dp_ip", "config_path")


def check_reported_engines(
    engines: Sequence[types_pb2.Engine], unchanged: Collection[int] = (), where: str = "engines"
) -> None:
    """INVALID_ARGUMENT naming the field (`engines[3].engine_id ...`) of the first engine a node
    reports whose id is not '<instance_id>/rank<n>' or whose text holds a control character:
    checked before anything of the report is kept (nothing stored, fenced or logged).
    `unchanged`: the places of the engines reported exactly as in the node's last report,
    checked then: not checked twice (a full heartbeat repeats them all, every beat)."""
    for i, engine in enumerate(engines):
        if i in unchanged:
            continue
        if names.ENGINE_ID_PATTERN.fullmatch(engine.engine_id) and not names.CONTROL_CHARACTER.search(
            "".join(value for _, value in reported_text(engine))
        ):
            continue  # a new or changed engine, fine: one regex each
        check_reported_engine(engine, f"{where}[{i}]")


def check_reported_engine(engine: types_pb2.Engine, where: str) -> None:
    names.parse_engine_id(engine.engine_id, f"{where}.engine_id")
    for field, value in reported_text(engine):
        names.check_printable(value, f"{where}.{field}")


def reported_text(engine: types_pb2.Engine) -> Iterator[tuple[str, str]]:
    """(field, value) of each text of a reported engine that reaches events, logs, addresses or command lines."""
    for name in REPORTED_TEXT:
        yield name, getattr(engine, name)
    for name in REPORTED_SPEC_TEXT:
        yield f"spec.{name}", getattr(engine.spec, name)
