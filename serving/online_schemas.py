"""Request and response bodies of the online endpoints (``/v1/online``, see
:mod:`serving.api.online`): a message is Table I (:class:`envs.dsmd.message.Message`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, model_validator

from envs.dsmd.message import CONFIG_NAMES, OPERATION_NAMES, Message, table1_problem

from .schemas import (
    MAX_JSON_INT,
    ControllerIn,
    IdList,
    JsonFloat,
    JsonInt,
    NodeIn,
    NsTime,
    _json_int,
    _json_number,
    at_most,
    request_body,
)

__all__ = [
    "DATASET_NAME",
    "IntervalOut",
    "MessageIn",
    "MessagesIn",
    "MessagesOut",
    "OnlinePolicyOut",
    "OnlineSessionCreate",
    "OnlineSessionCreated",
    "OnlineSessionOut",
    "PlacedOut",
    "PlacementIn",
    "PlanIn",
    "PlanOut",
    "PlannedIn",
    "PlannedOut",
    "ScenarioIn",
    "messages_body",
]

_UINT32 = 2**32 - 1
#: resource ids are unsigned 64-bit (409 above; :func:`serving.schemas.at_most`)
ResourceId = Annotated[int, Field(ge=0), BeforeValidator(_json_int),
                       at_most(2**64 - 1, "a resource id (64-bit)")]
Seconds = Annotated[float, Field(gt=0, le=86400), BeforeValidator(_json_number)]
_MAX = MAX_JSON_INT
_STRICT = ConfigDict(extra="forbid")
#: a dataset config's name: a bare name, never a path (the server also requires it to be
#: one of the dataset configs it ships)
DATASET_NAME = r"^[A-Za-z0-9][A-Za-z0-9_]{0,99}$"
_PosInt = Annotated[int, Field(ge=1, le=_MAX), BeforeValidator(_json_int)]
_NonNegInt = Annotated[int, Field(ge=0, le=_MAX), BeforeValidator(_json_int)]
_Num = Annotated[float, Field(ge=0, le=1e18), BeforeValidator(_json_number)]
_PosNum = Annotated[float, Field(gt=0, le=1e18), BeforeValidator(_json_number)]
_Share = Annotated[float, Field(ge=0, le=1), BeforeValidator(_json_number)]
_Scalar = str | JsonInt | JsonFloat | bool | None


class ScenarioIn(BaseModel):
    """A :class:`envs.dsmd.scenarios.ScenarioSpec` as a request carries it (what
    ``ScenarioSpec.to_dict`` writes; a dataset manifest's ``scenario``): every field typed
    and bounded, so no value reaches the simulator that it cannot hold. The spec's own
    checks (e.g. phase durations adding up to ``duration_s``) answer 409."""

    model_config = _STRICT
    name: str = Field(min_length=1, max_length=100)
    num_nodes: _PosInt
    num_vms: _PosInt
    num_vpcs: _PosInt
    num_topics: Annotated[int, Field(ge=1, le=4096), BeforeValidator(_json_int)] = Field(
        description="K (at most the server's limits.max_topics).")
    node_bandwidth_bps: _PosInt
    controller_bw_bps: _PosInt
    controller_cpu: _PosInt
    interval_s: Seconds = 10.0
    duration_s: _PosNum = 60.0
    rate_per_vpc_bps: _Num | None = 1e6
    peak_rate_bps: _Num | None = None
    phases: list[Annotated[list[_Num], Field(min_length=2, max_length=2)]] = Field(
        default_factory=list, max_length=1000, description="(duration_s, multiplier) pairs.")
    mean_size_bytes: _PosNum = 512 * 1024
    top_share: _Share = 0.8
    size_range: _PosNum = 1e4
    multicast_share: _Share = 0.5
    max_subnets: _NonNegInt = 3
    max_security_groups: _NonNegInt = 2
    vpc_size_sigma: _Num = 1.0
    messages_per_request: _Num = 1.5
    seed: Annotated[int, Field(ge=0, le=2**32 - 1), BeforeValidator(_json_int)] = 0
    split: Annotated[list[_Share], Field(min_length=3, max_length=3)] = Field(
        default_factory=lambda: [0.6, 0.2, 0.2])
    extra: dict[Annotated[str, Field(max_length=100)], _Scalar] = Field(
        default_factory=dict, max_length=100, description="Per-scenario baseline "
        "parameters.")


class MessageIn(BaseModel):
    """One southbound message (Table I), as the adapter's trace log keeps it."""

    model_config = _STRICT
    message_id: JsonInt = Field(ge=0, le=_UINT32, description="Unique in the session.")
    request_id: JsonInt = Field(ge=0, le=_UINT32)
    vpc_id: JsonInt = Field(ge=0, le=_UINT32)
    configuration_type: str = Field(max_length=64, json_schema_extra={
        "enum": list(CONFIG_NAMES)})
    operation_type: str = Field(max_length=64, json_schema_extra={
        "enum": list(OPERATION_NAMES)})
    resource_id: ResourceId
    size_bytes: JsonInt = Field(gt=0, le=_MAX)
    hosts: IdList = Field(min_length=1, description="D(m): destination node ids.")
    timestamp_ns: NsTime = Field(description="Send time, ns since the epoch; "
                              "not earlier than the previous message's.")

    @model_validator(mode="after")
    def _table1(self) -> MessageIn:
        problem = table1_problem(self.configuration_type, self.operation_type, self.hosts)
        if problem is not None:
            raise ValueError(problem)
        return self

    def to_message(self) -> Message:
        return Message(self.message_id, self.request_id, self.vpc_id, self.configuration_type,
                       self.operation_type, self.resource_id, self.size_bytes,
                       tuple(self.hosts), self.timestamp_ns)

    @classmethod
    def build(cls, m: Message) -> MessageIn:
        """The model of a message the caller already holds as a :class:`Message` (not
        validated again here: the server validates every message it receives)."""
        return cls.model_construct(
            message_id=m.message_id, request_id=m.request_id, vpc_id=m.vpc_id,
            configuration_type=m.configuration_type, operation_type=m.operation_type,
            resource_id=m.resource_id, size_bytes=m.size_bytes, hosts=list(m.hosts),
            timestamp_ns=m.timestamp_ns)

    @classmethod
    def of(cls, m: Message) -> dict[str, Any]:
        """A message as a request body item."""
        return cls.build(m).model_dump(mode="json")


class OnlineSessionCreate(BaseModel):
    """The controller's nodes, and its K, C_b, C_p and T: from a scenario (a dataset's
    ``scenario``, or a dataset config's name) or given one by one."""

    model_config = _STRICT
    nodes: list[NodeIn] = Field(min_length=1, description="Every compute node and its s(n).")
    scenario: ScenarioIn | None = Field(default=None, description="A ScenarioSpec "
                                        "(e.g. a trace dataset's manifest 'scenario').")
    dataset: str | None = Field(default=None, max_length=100, pattern=DATASET_NAME,
                                description="Or the name of a dataset config the server "
                                "ships (GET /v1/online/datasets lists them): its scenario.")
    controller: ControllerIn | None = Field(default=None, description="C_b and C_p (without "
                                            "a scenario; with one they must agree).")
    num_topics: Annotated[int, Field(ge=1, le=4096), BeforeValidator(_json_int)] | None = (
        Field(default=None, description="K."))
    interval_s: Seconds | None = Field(default=None, description="T, seconds.")
    start_ns: NsTime | None = Field(default=None, description="Start of "
                                 "interval 0 (default: the first message's time).")
    batch_key: Literal["hosts", "hosts+vpc", "hosts+vpc+config"] = "hosts"
    name: str = Field(default="live", min_length=1, max_length=100,
                      pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
    cost: dict[Annotated[str, Field(max_length=64)], JsonFloat] | None = Field(
        default=None, max_length=64, description="OnlineCost weights (w_delay, "
                                          "w_violation, w_subscribe, w_move) the intervals "
                                          "are scored with (default: the loaded online "
                                          "policy's); the delay model is always the loaded "
                                          "policy's (or the server's default).")


class OnlineSessionCreated(BaseModel):
    session_id: str
    window: int = Field(description="The interval to plan first (0).")
    start_ns: int | None
    scenario: dict
    cost: dict
    policy_version: int = Field(description="The online policy loaded now (0: none).")


class OnlineSessionOut(BaseModel):
    session_id: str
    window: int = Field(description="The open interval (or the next to open).")
    planned: bool = Field(description="Whether that interval has its plan.")
    start_ns: int | None
    num_types: int = Field(description="Types seen so far.")
    last: dict | None = Field(description="The realised terms of the last closed interval.")
    scenario: dict
    cost: dict
    batch_key: str
    policy_version: int = Field(description="The version that planned the open interval, "
                                "else the one loaded now (0: none).")


class PlannedIn(BaseModel):
    model_config = _STRICT
    type: JsonInt = Field(ge=0, le=_MAX)
    channel: JsonInt = Field(ge=0, le=4096, description="0 = RPC, t = MQ topic t.")
    expected_rate_bps: JsonInt = Field(ge=0, le=_MAX)


class PlannedOut(BaseModel):
    type: int
    channel: int
    expected_rate_bps: int


class PlanIn(BaseModel):
    """A plan decided elsewhere (restoring a session's history)."""

    model_config = _STRICT
    plan: list[PlannedIn]


class PlanOut(BaseModel):
    window: int
    plan: list[PlannedOut] = Field(description="The types (re)planned at the boundary; every "
                                   "other type keeps its channel.")
    source: Literal["policy", "fallback", "given"]
    knobs: dict[str, float | None] | None = Field(description="The executor's knobs the "
                                                  "policy set (a horizon of null: infinite, "
                                                  "every type re-planned).")
    observation: list[float] | None = Field(description="The policy's observation "
                                            "(features, in order).")
    features: list[str] | None
    policy_version: int


class PlacementIn(BaseModel):
    model_config = _STRICT
    type: JsonInt = Field(ge=0, le=_MAX)
    channel: JsonInt = Field(ge=0, le=4096)


class MessagesIn(BaseModel):
    model_config = _STRICT
    messages: list[MessageIn] = Field(min_length=1, description="In time order.")
    placements: list[PlacementIn] = Field(default_factory=list, description="Channels "
                                          "decided elsewhere for types these messages "
                                          "place (restoring a session's history).")


def messages_body(msgs: Sequence[Message], given: Mapping[int, int]) -> dict[str, Any]:
    """``POST .../intervals/{w}/messages`` body (:class:`MessagesIn`): ``msgs`` in order and
    the channels ``given`` (type -> channel) decided elsewhere."""
    return request_body(MessagesIn.model_construct(
        messages=[MessageIn.build(m) for m in msgs],
        placements=[PlacementIn(type=t, channel=c) for t, c in given.items()]))


class PlacedOut(BaseModel):
    type: int
    channel: int
    message_id: int = Field(description="The type's first message of the interval.")
    previous_channel: int = Field(description="-1: a new type; else a returning one.")
    rate_bps: int = Field(description="The estimate 8 size / T it was placed with.")
    source: Literal["policy", "fallback", "given"]


class MessagesOut(BaseModel):
    window: int
    types: list[int] = Field(description="Each message's type id.")
    channels: list[int] = Field(description="Each message's channel (0 = RPC, t = topic).")
    placed: list[PlacedOut]
    policy_version: int


class IntervalOut(BaseModel):
    window: int
    types: list[int] = Field(description="The types that sent in the interval.")
    channels: list[int] = Field(description="Their channels.")
    terms: dict[str, int | float] = Field(description="The interval's realised terms (cost, "
                                    "redundancy_ratio, violation, subscribe_infos, ...).")
    next_window: int


class OnlinePolicyOut(BaseModel):
    loaded: bool
    version: int = Field(description="Increases with every load (0: none).")
    hash: str | None = Field(description="SHA-256 of actor.onnx.")
    name: str | None = Field(default=None, description="The bundle's name (its directory's "
                             "name on the server; never a path).")
    loaded_at: float | None = None
    origin: str | None = Field(default=None, description="The registry version it was "
                               "loaded from (models:/<name>/<version>, and the alias); null "
                               "for a directory.")
    features: list[str] | None = None
    knob_map: dict | None = None
    cost: dict | None = None
    dataset: dict | None = None
