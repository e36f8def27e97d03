"""Request and response models of the policy server's ``/v1`` API (pydantic; separate models
for what comes in and what goes out, every field documented so the OpenAPI document is
complete).

They are the one definition of the wire format: the server parses every request body with
them, and the clients (:mod:`serving.client.static`, :mod:`serving.client.online`,
:mod:`serving.scenario`) build every body from them with :func:`request_body`."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, Strict
from pydantic_core import PydanticCustomError

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
    "IdList",
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

#: the largest integer every JSON client holds exactly (an IEEE double's 53-bit mantissa):
#: the bound of every id, count and rate
MAX_JSON_INT = 2**53 - 1
#: the bound of nanosecond times (2**62 ns: the year 2116). Above 2**53, where JSON clients
#: and schema validators disagree on integers, so it is not a schema ``maximum``: the
#: server refuses a larger time with 409 (:func:`at_most`)
MAX_NS = 2**62
#: the 409 of a value the schema allows that the server cannot hold (:func:`at_most`)
OUT_OF_RANGE = "out_of_range"
_MAX = MAX_JSON_INT
_STRICT = ConfigDict(extra="forbid")


def _json_int(v: Any) -> Any:
    """Only a JSON integer is an integer: not ``true``/``false`` or a string of digits (the
    lax conversions pydantic would make); a number with a zero fraction (``3.0``) is one,
    as JSON Schema says."""
    if isinstance(v, bool | str | bytes):
        raise PydanticCustomError("int_type", "Input should be an integer, not {kind}",
                                  {"kind": "a boolean" if isinstance(v, bool) else "a string"})
    if isinstance(v, float) and v.is_integer():
        return int(v)
    return v


def _json_number(v: Any) -> Any:
    """Only a JSON number is a number (not ``true``/``false`` or a string)."""
    if isinstance(v, bool | str | bytes):
        raise PydanticCustomError("float_type", "Input should be a number, not {kind}",
                                  {"kind": "a boolean" if isinstance(v, bool) else "a string"})
    return v


def at_most(bound: int, what: str) -> AfterValidator:
    """An upper bound above 2**53, which no JSON Schema ``maximum`` states reliably (clients
    and validators that hold numbers as doubles cannot tell integers near it apart): not in
    the schema, checked here, refused with 409 (:data:`OUT_OF_RANGE`, mapped by the app)."""

    def check(v: int) -> int:
        if v > bound:
            raise PydanticCustomError(OUT_OF_RANGE, "{what} must be at most {le}",
                                      {"le": bound, "what": what})
        return v

    return AfterValidator(check)


# (a constraint before the BeforeValidator: so it shows as minimum/maximum in the schema
# of a list's items and of an optional field too)
#: an integer field of a request: JSON integers only (``seed: false`` is refused)
JsonInt = Annotated[int, BeforeValidator(_json_int)]
#: a number field of a request: JSON numbers only
JsonFloat = Annotated[float, BeforeValidator(_json_number)]
#: a boolean field of a request: ``true`` or ``false`` only (not 1, 0 or "yes")
JsonBool = Annotated[bool, Strict()]
#: an id, rate or count (>= 0)
Id = Annotated[int, Field(ge=0, le=MAX_JSON_INT), BeforeValidator(_json_int)]


def _json_ints(v: Any) -> Any:
    """A list of JSON integers, checked in one call: the common case (every item already an
    ``int``, not a ``bool``) passes as it is; otherwise each item as :func:`_json_int` takes
    it (``3.0`` is 3), and an item that is not an integer is left for the strict item type
    to refuse at its index."""
    if isinstance(v, list):
        for x in v:
            if type(x) is not int:
                return [_item(x) for x in v]
    return v


def _item(x: Any) -> Any:
    if isinstance(x, float) and x.is_integer():
        return int(x)
    return x


#: a list of ids (node ids of D(m), type ids): one validator call for the list, not one per
#: item (a 20,000-type session lists hundreds of thousands of them)
IdList = Annotated[list[Annotated[int, Field(ge=0, le=MAX_JSON_INT), Strict()]],
                   BeforeValidator(_json_ints)]
#: a count (>= 1)
Count = Annotated[int, Field(ge=1, le=MAX_JSON_INT), BeforeValidator(_json_int)]
#: a channel as a session holds it (-1 undecided, 0 RPC, t topic t)
Channel = Annotated[int, Field(ge=-1, le=4096), BeforeValidator(_json_int)]
#: a time in ns since the epoch (at most :data:`MAX_NS`: 409 above)
NsTime = Annotated[int, Field(ge=0), BeforeValidator(_json_int),
                   at_most(MAX_NS, "a time in ns (2**62: the year 2116)")]


def request_body(model: BaseModel) -> dict[str, Any]:
    """``model`` (a request model, validated when it was built) as the JSON body the server
    parses back into the same model: the fields the caller set, in the model's field order,
    as JSON types (a field left at its default is left out, and the server fills the same
    default in)."""
    return model.model_dump(mode="json", exclude_unset=True)


# ---------------------------------------------------------------------- requests
class NodeIn(BaseModel):
    model_config = _STRICT
    id: JsonInt = Field(ge=0, le=_MAX, description="Compute node id (as the controller knows it).")
    capacity_bps: JsonInt = Field(gt=0, le=_MAX, description="s(n): the node's bandwidth for "
                              "southbound messages, bit/s.")


class ControllerIn(BaseModel):
    model_config = _STRICT
    bandwidth_bps: JsonInt = Field(gt=0, le=_MAX, description="C_b: controller bandwidth, bit/s.")
    cpu: JsonInt = Field(gt=0, le=_MAX, description="C_p: messages the controller can send per "
                     "interval.")


class TypeIn(BaseModel):
    model_config = _STRICT
    id: JsonInt = Field(ge=0, le=_MAX, description="The controller's id of the message type "
                    "(e.g. its index in the adapter's TypeCatalog).")
    destinations: IdList = Field(min_length=1, description="D(m): destination node ids.")
    rate_bps: Id | None = Field(default=None, description="Current f(m), "
                                 "bit/s (restoring a session).")
    messages: Count | None = None
    channel: Channel | None = Field(default=None, description="Current channel "
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
    since_ns: NsTime = Field(default=0, description="Unix time (ns) of the "
                          "last MQ state change (0: never changed).")
    rerouted: IdList = Field(
        default_factory=list, description="Types moved from their topic to RPC while the MQ "
        "channel is down.")
    waiting: IdList = Field(
        default_factory=list, description="Types held until the MQ channel is back (RPC had "
        "no room for them within C_b and C_p).")
    unreachable: IdList = Field(
        default_factory=list, description="Nodes whose RPC endpoint is down.")
    relayed: IdList = Field(
        default_factory=list, description="Of the unreachable nodes, those reached through "
        "a topic they subscribe to instead.")


class SessionCreate(BaseModel):
    model_config = _STRICT
    nodes: list[NodeIn] = Field(min_length=1, description="Every compute node.")
    controller: ControllerIn
    num_topics: JsonInt = Field(ge=0, le=4096, description="K: MQ topics.")
    interval_s: JsonFloat = Field(default=1.0, gt=0, le=86400, description="Rate-estimation "
                              "interval T, seconds.")
    types: list[TypeIn] = Field(default_factory=list, description="Known message types.")
    scenario_signature: dict[str, str | JsonInt | JsonFloat] = Field(
        default_factory=dict, description="Optional facts the policy must match (keys of a "
        "bundle's scenario_signature, e.g. num_nodes, topology).")
    seed: JsonInt = Field(default=0, ge=0, le=2**32 - 1, description="Seed of the session's "
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
    type: JsonInt = Field(ge=0, le=_MAX, description="Type id.")
    rate_bps: JsonInt = Field(ge=0, le=_MAX, description="f(m), bit/s (0: inactive).")
    messages: Count | None = Field(default=None, description="Messages in the "
                                 "interval (optional).")


class RateUpdate(BaseModel):
    model_config = _STRICT
    rates: list[RateIn] = Field(description="New estimates.")
    replace: JsonBool = Field(default=False, description="The interval's whole estimate: types "
                          "not listed become inactive.")


class DecideRequest(BaseModel):
    model_config = _STRICT
    type: JsonInt = Field(ge=0, le=_MAX, description="The type to decide (re-decided if it "
                      "already has a channel).")
    explain: JsonBool = Field(default=False, description="Return the observation and scores.")


class DecideBatchRequest(BaseModel):
    model_config = _STRICT
    types: IdList | None = Field(default=None, description="Types to decide, in order; "
                                    "null: every active undecided type (all with replan) in "
                                    "the policy's decision order.")
    replan: JsonBool = Field(default=False, description="Clear the assignment first (one "
                         "environment episode).")
    parallel: JsonBool = Field(default=False, description="Score every type from the batch's "
                           "starting state in one policy call (fast; observations do not see "
                           "the batch's earlier decisions), instead of one by one.")
    explain: JsonBool = False


class PolicySwap(BaseModel):
    model_config = _STRICT
    path: str = Field(min_length=1, max_length=4096, description="Bundle directory on the "
                      "server, or a registered model: models:/<name>@<alias> or "
                      "models:/<name>/<version> (in the server's registry).")
    force: JsonBool = Field(default=False, description="Load even if live sessions do not match "
                        "it (they then get heuristic decisions).")
    allow_rollback: JsonBool = Field(default=False, description="Load it even if its signed "
                                     "serial is below the highest this server has loaded (an "
                                     "older bundle, on purpose; audited).")


# ---------------------------------------------------------------------- responses
class PolicyOut(BaseModel):
    loaded: bool = Field(description="Whether a policy bundle is loaded.")
    version: int = Field(description="Increases with every load (0: none).")
    hash: str | None = Field(description="SHA-256 of the actor (ONNX).")
    name: str | None = Field(default=None, description="The bundle's name (its directory's "
                             "name on the server; never a path).")
    loaded_at: float | None = Field(default=None, description="Unix time of the load.")
    origin: str | None = Field(default=None, description="The registry version it was "
                               "loaded from (models:/<name>/<version>, and the alias); null "
                               "for a directory.")
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


#: the error responses of every endpoint (OpenAPI), by status: one table for the static
#: and the online API (an endpoint may give a status a more precise description)
ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    400: {"model": ErrorOut, "description": "Body is not parseable (not JSON)"},
    401: {"model": ErrorOut, "description": "Missing or invalid API key"},
    403: {"model": ErrorOut, "description": "The key's role may not do this"},
    404: {"model": ErrorOut, "description": "Unknown session"},
    409: {"model": ErrorOut, "description": "Contradicts the session's state or itself "
          "(names what)"},
    413: {"model": ErrorOut, "description": "Body too large"},
    422: {"model": ErrorOut, "description": "Validation error (field and problem)"},
    429: {"model": ErrorOut, "description": "Too many sessions, or over a memory budget"}}


def error_responses(*codes: int) -> dict[int | str, dict[str, Any]]:
    """The OpenAPI ``responses`` of ``codes`` (:data:`ERROR_RESPONSES`)."""
    return {c: ERROR_RESPONSES[c] for c in codes}
