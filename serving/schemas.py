"""Request and response models of the policy server's ``/v1`` API (pydantic; separate models
for what comes in and what goes out, every field documented so the OpenAPI document is
complete).

They are the one definition of the wire format: the server parses every request body with
them, and the clients (:mod:`serving.adapter`, :mod:`serving.online_adapter`,
:mod:`serving.scenario`) build every body from them with :func:`request_body`."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

__all__ = [
    "ChannelHealth",
    "ControllerIn",
    "DecideBatchRequest",
    "DecideRequest",
    "DecisionBatchOut",
    "DecisionOut",
    "DecisionSingleOut",
    "ErrorOut",
    "HealthOut",
    "NodeIn",
    "PolicyOut",
    "PolicySwap",
    "RateIn",
    "RateUpdate",
    "RateUpdated",
    "SessionCreate",
    "SessionCreated",
    "SessionHealthOut",
    "SessionOut",
    "SessionUpdate",
    "TypeIn",
    "TypeOut",
    "request_body",
]

_INT64 = 2**63 - 1
_STRICT = ConfigDict(extra="forbid")


def request_body(model: BaseModel) -> dict[str, Any]:
    """``model`` (a request model, validated when it was built) as the JSON body the server
    parses back into the same model: the fields the caller set, in the model's field order,
    as JSON types (a field left at its default is left out, and the server fills the same
    default in)."""
    return model.model_dump(mode="json", exclude_unset=True)


# ---------------------------------------------------------------------- requests
class NodeIn(BaseModel):
    model_config = _STRICT
    id: int = Field(ge=0, le=_INT64, description="Compute node id (as the controller knows it).")
    capacity_bps: int = Field(gt=0, le=_INT64, description="s(n): the node's bandwidth for "
                              "southbound messages, bit/s.")


class ControllerIn(BaseModel):
    model_config = _STRICT
    bandwidth_bps: int = Field(gt=0, le=_INT64, description="C_b: controller bandwidth, bit/s.")
    cpu: int = Field(gt=0, le=_INT64, description="C_p: messages the controller can send per "
                     "interval.")


class TypeIn(BaseModel):
    model_config = _STRICT
    id: int = Field(ge=0, le=_INT64, description="The controller's id of the message type "
                    "(e.g. its index in the adapter's TypeCatalog).")
    destinations: list[int] = Field(min_length=1, description="D(m): destination node ids.")
    rate_bps: int | None = Field(default=None, ge=0, le=_INT64, description="Current f(m), "
                                 "bit/s (restoring a session).")
    messages: int | None = Field(default=None, ge=1, le=_INT64)
    channel: int | None = Field(default=None, ge=-1, le=4096, description="Current channel "
                                "(restoring a session; -1 = undecided).")


class ChannelHealth(BaseModel):
    """The controller's channels as it sees them now (issue 20's channel failover): whether
    the MQ channel is usable, which types it moved to RPC or holds while it is not, and which
    nodes' RPC endpoints are down. The server keeps it with the session and announces every
    change (Stemflow Section IV, subscribed global knowledge); the static policies do not use
    it as an input (the controller applies failover itself), a policy may."""

    model_config = _STRICT
    mq: Literal["up", "down"] = Field(default="up", description="The MQ channel (broker) "
                                      "state.")
    since_ns: int = Field(default=0, ge=0, le=_INT64, description="Unix time (ns) of the "
                          "last MQ state change (0: never changed).")
    rerouted: list[Annotated[int, Field(ge=0, le=_INT64)]] = Field(
        default_factory=list, description="Types moved from their topic to RPC while the MQ "
        "channel is down.")
    waiting: list[Annotated[int, Field(ge=0, le=_INT64)]] = Field(
        default_factory=list, description="Types held until the MQ channel is back (RPC had "
        "no room for them within C_b and C_p).")
    unreachable: list[Annotated[int, Field(ge=0, le=_INT64)]] = Field(
        default_factory=list, description="Nodes whose RPC endpoint is down.")
    relayed: list[Annotated[int, Field(ge=0, le=_INT64)]] = Field(
        default_factory=list, description="Of the unreachable nodes, those reached through "
        "a topic they subscribe to instead.")


class SessionCreate(BaseModel):
    model_config = _STRICT
    nodes: list[NodeIn] = Field(min_length=1, description="Every compute node.")
    controller: ControllerIn
    num_topics: int = Field(ge=0, le=4096, description="K: MQ topics.")
    interval_s: float = Field(default=1.0, gt=0, le=86400, description="Rate-estimation "
                              "interval T, seconds.")
    types: list[TypeIn] = Field(default_factory=list, description="Known message types.")
    scenario_signature: dict[str, str | int | float] = Field(
        default_factory=dict, description="Optional facts the policy must match (keys of a "
        "bundle's scenario_signature, e.g. num_nodes, topology).")
    seed: int = Field(default=0, ge=0, le=2**32 - 1, description="Seed of the session's "
                      "tie-breaking RNG.")
    channel_health: ChannelHealth | None = Field(default=None, description="The "
                                                 "controller's channel health (restoring a "
                                                 "session; null: not reported).")


class SessionUpdate(BaseModel):
    model_config = _STRICT
    types: list[TypeIn] = Field(default_factory=list, description="Types to add.")
    channel_health: ChannelHealth | None = Field(default=None, description="The "
                                                 "controller's channel health now (replaces "
                                                 "the stored one and is announced; null: "
                                                 "unchanged).")


class RateIn(BaseModel):
    model_config = _STRICT
    type: int = Field(ge=0, le=_INT64, description="Type id.")
    rate_bps: int = Field(ge=0, le=_INT64, description="f(m), bit/s (0: inactive).")
    messages: int | None = Field(default=None, ge=1, le=_INT64, description="Messages in the "
                                 "interval (optional).")


class RateUpdate(BaseModel):
    model_config = _STRICT
    rates: list[RateIn] = Field(description="New estimates.")
    replace: bool = Field(default=False, description="The interval's whole estimate: types "
                          "not listed become inactive.")


class DecideRequest(BaseModel):
    model_config = _STRICT
    type: int = Field(ge=0, le=_INT64, description="The type to decide (re-decided if it "
                      "already has a channel).")
    explain: bool = Field(default=False, description="Return the observation and scores.")


class DecideBatchRequest(BaseModel):
    model_config = _STRICT
    types: list[int] | None = Field(default=None, description="Types to decide, in order; "
                                    "null: every active undecided type (all with replan) in "
                                    "the policy's decision order.")
    replan: bool = Field(default=False, description="Clear the assignment first (one "
                         "environment episode).")
    parallel: bool = Field(default=False, description="Score every type from the batch's "
                           "starting state in one policy call (fast; observations do not see "
                           "the batch's earlier decisions), instead of one by one.")
    explain: bool = False


class PolicySwap(BaseModel):
    model_config = _STRICT
    path: str = Field(min_length=1, max_length=4096, description="Bundle directory on the "
                      "server.")
    force: bool = Field(default=False, description="Load even if live sessions do not match "
                        "it (they then get heuristic decisions).")


# ---------------------------------------------------------------------- responses
class PolicyOut(BaseModel):
    loaded: bool = Field(description="Whether a policy bundle is loaded.")
    version: int = Field(description="Increases with every load (0: none).")
    hash: str | None = Field(description="SHA-256 of the actor (ONNX).")
    path: str | None = None
    loaded_at: float | None = Field(default=None, description="Unix time of the load.")
    scenario_signature: dict = Field(default_factory=dict)
    observation: dict = Field(default_factory=dict, description="Observation layout.")
    decoding: str | None = None
    decision_order: str | None = None
    algorithm: str | None = None
    fallback: str = Field(description="Heuristic used when the policy cannot decide.")


class TypeOut(BaseModel):
    id: int
    destinations: list[int]
    rate_bps: int
    messages: int
    channel: int = Field(description="0 = RPC, t = topic t, -1 = undecided.")


class SessionCreated(BaseModel):
    session_id: str
    version: int
    policy_compatible: bool
    reason: str | None = Field(description="Why the policy cannot decide here (heuristic "
                               "decisions), if so.")


class SessionOut(BaseModel):
    session_id: str
    version: int
    nodes: list[dict]
    controller: dict
    num_topics: int
    interval_s: float
    scenario_signature: dict
    seed: int
    types: list[TypeOut]
    metrics: dict = Field(description="Eq. 1 quantities of the current assignment.")
    policy_compatible: bool
    reason: str | None
    channel_health: ChannelHealth | None = Field(default=None, description="The "
                                                 "controller's last reported channel health "
                                                 "(null: never reported).")


class SessionHealthOut(BaseModel):
    session_id: str
    version: int = Field(description="The session's version.")
    channel_health: ChannelHealth | None = Field(description="The controller's last reported "
                                                 "channel health (null: never reported).")


class RateUpdated(BaseModel):
    version: int
    active_types: int


class DecisionOut(BaseModel):
    type: int
    channel: int = Field(description="0 = RPC, t = MQ topic t.")
    source: Literal["policy", "fallback"]
    reason: str | None = Field(default=None, description="Why the heuristic decided.")
    observation: list[float] | None = None
    scores: list[float] | None = None


class DecisionSingleOut(DecisionOut):
    policy_version: int = Field(description="The policy version that decided (0: none).")
    policy_hash: str | None
    session_version: int


class DecisionBatchOut(BaseModel):
    decisions: list[DecisionOut]
    policy_version: int = Field(description="The one policy version used for every decision "
                                "of this response (0: none).")
    policy_hash: str | None
    session_version: int


class HealthOut(BaseModel):
    status: Literal["ok", "unavailable"]
    policy_loaded: bool
    sessions: int


class ErrorOut(BaseModel):
    detail: str | list = Field(description="What is wrong, and where.")
