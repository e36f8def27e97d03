"""Table I messages on the wire: :class:`envs.dsmd.message.Message` <-> the protobuf
``ConfigMessage`` (``delivery/protos/smart_delivery.proto``), the MQ envelope, and the checks
an agent runs on what it receives (a malformed message is rejected and reported; the agent
keeps running, Section VI)."""

from __future__ import annotations

from dataclasses import dataclass

from envs.dsmd.message import Message, table1_problem

from .rpc import pb

__all__ = [
    "Payloads",
    "WireError",
    "check_config",
    "check_subscribe",
    "decode_config",
    "encode",
    "envelope",
    "fence_envelope",
    "open_envelope",
    "resource_key",
]


class WireError(ValueError):
    """A message or SubscribeInfo that cannot be accepted; the text names the field."""


class Payloads:
    """Opaque payload bytes of a given size (``size_bytes * scale``, at least 1 byte): the
    testbed sends real bytes, scaled so a 2-core loopback machine can carry the trace."""

    def __init__(self, scale: float = 1.0) -> None:
        if not 0 < scale <= 1:
            raise WireError(f"payload scale must be in (0, 1], got {scale}")
        self.scale = float(scale)
        self._buf = b"\x5a" * 4096

    def of(self, size_bytes: int) -> bytes:
        n = max(1, int(size_bytes * self.scale))
        if n > len(self._buf):
            self._buf = b"\x5a" * (2 * n)
        return self._buf[:n]


def encode(msg: Message, type_id: int, payload: bytes, reprogram: bool = False
           ) -> pb.ConfigMessage:
    """The wire form of a Table I message of type ``type_id``."""
    return pb.ConfigMessage(message_id=msg.message_id, request_id=msg.request_id,
                            vpc_id=msg.vpc_id, timestamp_ns=msg.timestamp_ns,
                            configuration_type=msg.configuration_type,
                            operation_type=msg.operation_type, resource_id=msg.resource_id,
                            hosts=msg.hosts, type_id=int(type_id), payload=payload,
                            reprogram=reprogram)


def check_config(cm: pb.ConfigMessage) -> None:
    """Raise :class:`WireError` naming the first bad field of a received message."""
    if cm.timestamp_ns <= 0:
        raise WireError(f"message {cm.message_id}: timestamp_ns must be positive, got "
                        f"{cm.timestamp_ns}")
    problem = table1_problem(cm.configuration_type, cm.operation_type, cm.hosts)
    if problem is not None:
        raise WireError(f"message {cm.message_id}: {problem}")


def decode_config(cm: pb.ConfigMessage) -> Message:
    """Back to a Table I :class:`Message` (checked)."""
    check_config(cm)
    return Message(cm.message_id, cm.request_id, cm.vpc_id, cm.configuration_type,
                   cm.operation_type, cm.resource_id, max(len(cm.payload), 1),
                   tuple(cm.hosts), cm.timestamp_ns)


def resource_key(cm: pb.ConfigMessage) -> tuple[int, str, int]:
    """The configuration resource a message programs: (VPC, configuration type, resource
    id). The agent keeps the latest timestamp per key (Section VI-B)."""
    return (cm.vpc_id, cm.configuration_type, cm.resource_id)


def check_subscribe(info: pb.SubscribeInfo) -> None:
    """Raise :class:`WireError` naming the first bad field of a SubscribeInfo (Table II)."""
    if not info.url.startswith(("pulsar://", "pulsar+ssl://")):
        raise WireError(f"SubscribeInfo.url must be a pulsar:// URL, got {info.url[:80]!r}")
    if not info.topic or len(info.topic) > 512:
        raise WireError("SubscribeInfo.topic must be a non-empty topic name")
    if not info.subscription or len(info.subscription) > 256:
        raise WireError("SubscribeInfo.subscription must be a non-empty name")
    if info.timestamp_ns <= 0:
        raise WireError(f"SubscribeInfo.timestamp_ns must be positive, got {info.timestamp_ns}")


def envelope(cm: pb.ConfigMessage) -> bytes:
    return pb.TopicEnvelope(config=cm).SerializeToString()


def fence_envelope(timestamp_ns: int) -> bytes:
    return pb.TopicEnvelope(fence=pb.Fence(timestamp_ns=timestamp_ns)).SerializeToString()


@dataclass(frozen=True)
class Opened:
    config: pb.ConfigMessage | None
    fence_ns: int | None


def open_envelope(data: bytes) -> Opened:
    """Parse an MQ message; :class:`WireError` if it is not a valid envelope."""
    env = pb.TopicEnvelope()
    try:
        env.ParseFromString(data)
    except Exception as e:  # google.protobuf.message.DecodeError
        raise WireError(f"MQ message of {len(data)} bytes is not a TopicEnvelope ({e})") from None
    kind = env.WhichOneof("body")
    if kind == "config":
        return Opened(env.config, None)
    if kind == "fence":
        return Opened(None, env.fence.timestamp_ns)
    raise WireError(f"MQ message of {len(data)} bytes has neither a config nor a fence")
