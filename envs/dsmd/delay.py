"""Delivery delay of one interval's channels: a queueing model of Eq. 1's constrained
resources (SMART Section V-B), calibrated on the emulated network (``bench/bench_delay.py``).

Eq. 1 charges nothing for a resource used below its limit, but a real link queues long
before it is full, and the controller cares about how long its messages take. Here every
constrained resource ``r`` is one server with capacity ``C_r``:

* ``C_b``, the controller's link: every RPC copy and every MQ publish crosses it, plus the
  controller's own control traffic (agent polls, TLS, broker probes) that the testbed
  measures on an idle link: ``control_wire_bps_per_node`` per agent on the wire, which is
  ``1 / calibration_scale`` times as much in the model's units, because the testbed scales
  the payloads and the capacities by ``calibration_scale`` (``payload_scale / time_scale``)
  but not its control traffic;
* ``C_p``, the controller's concurrent sends: ``C_p`` servers, each RPC copy and each
  publish holds one for ``cpu_service_s``, so its utilisation is the sends per second times
  ``cpu_service_s`` over ``C_p`` (Little's law), not Eq. 1's sends per interval over ``C_p``;
* ``s(n)``, each node's link: everything on the node's topics (MQ redundancy included) and
  its own RPC copies, plus ``node_control_bps`` of control traffic (the agent's polls and
  replies, TLS and the broker's protocol: fitted, since no link of the testbed is idle
  while its agents run).

Its utilisation is ``rho_r = a_r load_r / C_r`` (``a_r``: wire bits per modelled bit, the
framing the model does not count; for ``C_b`` the control traffic is added to the load).
Below saturation the mean wait is Kingman's G/G/1 approximation (Kingman 1961),

    W_r = kappa_r * rho / (1 - rho) * E[S_r],     kappa_r = (c_a^2 + c_s^2) / 2,

with ``E[S_r]`` one mean message's service time and ``kappa_r`` the resource's burstiness.
The controller's link is offered batches: an RPC message leaves as one copy per destination
at once, an MQ message as one publish, so its arrivals are a compound stream whose ``c_a^2``
grows with the batch sizes' index of dispersion ``I = E[B^2] / E[B]`` (over the interval's
messages, ``B = |D(m)|`` over RPC and 1 over MQ). ``C_b``'s wait is Kingman's times ``I``,
with the rest of the burstiness (the controller's flushes, TCP) fitted in ``kappa``.
``C_p``, with ``c`` servers, uses Sakasegawa's G/G/c form (Sakasegawa 1977), the same with
``rho^(sqrt(2 (c + 1)) - 1) / (c (1 - rho))`` in place of ``rho / (1 - rho)``. A message
waits with probability ``P_r`` and then for an exponential time of mean ``W_r / P_r``
(M/M/1's shape). ``P_r`` is ``rho ** gamma_r`` for a link (``gamma = 1``: M/M/1's ``rho``;
fitted below 1, since the controller's pushes leave in batches and most of a batch waits)
and Sakasegawa's power of ``rho`` for ``C_p``. At ``rho >= 1`` the queue grows through the
interval (a fluid backlog): a message sent at ``t`` waits ``(rho - 1) t`` more, uniform on
``[0, (rho - 1) T]``, on top of the wait at ``rho_max``, where Kingman's formula is
capped.

A delivery (a message to one of its destinations) crosses ``C_b``, ``s(n)`` and, over RPC,
``C_p``; its delay is ``base_s`` plus the waits of those resources, whose means, waiting
probabilities and fluid spans add, plus the controller's **switch hold**: a switch of
channels (``Controller.set_channels``) sends its SubscribeInfos and waits for their
acknowledgements before the types it moves take their new channels, and the messages of
those types wait for it. An interval whose switches send ``S`` subscribing and ``U``
unsubscribing SubscribeInfos and move ``M`` types holds the deliveries it holds for

    H = hold_s_per_subscribe S + hold_s_per_unsubscribe U + hold_s_per_moved_type M

seconds, the costs ``bench/bench_switch_cost.py`` measured (``envs/dsmd/switching_costs.json``,
its fit of the switch's time with the two directions apart). Which deliveries it holds is
the load's ``held_share``: the controller gates only the moved types' messages, for the
subscribing SubscribeInfos (``U = 0``: the unsubscriptions come after the new channels took
effect), so ``held_share`` is the share of the interval's deliveries that belong to types
whose channel changed (or that were placed on a topic); a load recorded by a controller that
held its whole sending path for the whole switch has ``held_share = 1`` and both directions
counted. The holds come at the start of the interval (the boundary's switch, then the
placements of types on their first messages), so a held message sent at ``t`` waits
``max(0, H - t)`` first (:func:`_cdf_held`). The interval's delay distribution is the
mixture over nodes, channels and held or not, weighted by the messages delivered, and its
p50 and p95 are what :meth:`DelayModel.quantiles` returns.

Nothing here imports gymnasium.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import numpy as np

from .errors import DSMDError

__all__ = ["DELAY_MODEL", "DelayLoad", "DelayModel", "ResourceQueue", "delivery_share",
           "load_delay_model"]

#: The calibrated constants (``bench/bench_delay.py --write``), beside the switching costs.
DELAY_MODEL = Path(__file__).with_name("delay_model.json")
SWITCHING_COSTS = Path(__file__).with_name("switching_costs.json")


@dataclass(frozen=True)
class DelayLoad:
    """What the delay model needs of one interval: the loads of a channel table on its
    instance (:meth:`from_state`), in the simulator's units (payload bit/s, sends)."""

    interval_s: float
    controller_bw_bps: float  # C_b
    controller_cpu: float  # C_p
    controller_load_bps: float  # sum of RPC copies and publishes
    controller_sends: float  # RPC destinations + MQ types (Eq. 1's C_p load)
    send_rate: float  # sends per second: RPC copies (message x destination) + publishes
    batch_dispersion: float  # E[B^2] / E[B] of the controller's batches (RPC: |D|, MQ: 1)
    mean_message_bits: float
    node_capacity_bps: np.ndarray  # (N,) s(n)
    node_load_bps: np.ndarray  # (N,) b(n)
    node_rpc_messages: np.ndarray  # (N,) messages delivered to n over RPC in the interval
    node_mq_messages: np.ndarray  # (N,) messages delivered to n over MQ (its own only)
    # the interval's switches, as far as they hold messages (module docstring): subscribing
    # and unsubscribing SubscribeInfos, moved types, and the share of deliveries they hold
    subscribe_infos: float = 0.0
    moved_types: float = 0.0
    unsubscribe_infos: float = 0.0
    held_share: float = 1.0

    def with_switches(self, subscribe_infos: float, moved_types: float,
                      unsubscribe_infos: float = 0.0, held_share: float = 1.0) -> DelayLoad:
        """The same loads with the interval's switches: ``held_share`` of the deliveries
        wait for ``subscribe_infos`` subscribing and ``unsubscribe_infos`` unsubscribing
        SubscribeInfos and ``moved_types`` moves."""
        if not 0.0 <= held_share <= 1.0:
            raise DSMDError(f"delay load: held_share must be in [0, 1], got {held_share!r}")
        return replace(self, subscribe_infos=float(subscribe_infos),
                       moved_types=float(moved_types),
                       unsubscribe_infos=float(unsubscribe_infos),
                       held_share=float(held_share))

    @classmethod
    def from_state(cls, state: Any) -> DelayLoad:
        """The loads of a :class:`envs.dsmd.cost.CostState` (every type assigned)."""
        inst = state.inst
        n = inst.num_nodes
        msgs = np.asarray(inst.messages, np.float64)
        rpc = state.channel == 0
        fan = np.diff(inst.dest_ptr)
        node_rpc = np.bincount(inst.dest_idx, np.repeat(msgs * rpc, fan), minlength=n)
        node_mq = np.bincount(inst.dest_idx, np.repeat(msgs * ~rpc, fan), minlength=n)
        bits = float(np.sum(inst.rate_bps, dtype=np.float64)) * inst.interval_s
        sends = float(node_rpc.sum() + msgs[~rpc].sum()) / inst.interval_s
        batch = np.where(rpc, fan, 1).astype(np.float64)  # copies sent at once per message
        disp = float(msgs @ batch ** 2) / max(float(msgs @ batch), 1.0)
        return cls(float(inst.interval_s), float(inst.controller_bw_bps),
                   float(inst.controller_cpu), float(state.controller_bw),
                   float(state.controller_cpu), sends, max(disp, 1.0),
                   bits / max(float(msgs.sum()), 1.0),
                   np.asarray(inst.node_capacity_bps, np.float64),
                   np.asarray(state.node_traffic, np.float64), node_rpc, node_mq)

    def with_capacities(self, controller_bw_bps: float | None = None,
                        controller_cpu: float | None = None,
                        node_capacity_bps: float | np.ndarray | None = None) -> DelayLoad:
        """The same loads against other capacities (a testbed run's, in model units)."""
        out = self
        if controller_bw_bps is not None:
            out = replace(out, controller_bw_bps=float(controller_bw_bps))
        if controller_cpu is not None:
            out = replace(out, controller_cpu=float(controller_cpu))
        if node_capacity_bps is not None:
            out = replace(out, node_capacity_bps=np.broadcast_to(
                np.asarray(node_capacity_bps, np.float64), self.node_load_bps.shape).copy())
        return out

    def to_dict(self) -> dict[str, Any]:
        return {f.name: (getattr(self, f.name).tolist()
                         if isinstance(getattr(self, f.name), np.ndarray)
                         else getattr(self, f.name)) for f in fields(self)}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> DelayLoad:
        if "batch_dispersion" not in d:  # recorded before it was: a Poisson stream's
            d = {**d, "batch_dispersion": 1.0}
        if "send_rate" not in d and "node_rpc_messages" in d:  # RPC copies only
            d = {**d, "send_rate": float(np.sum(d["node_rpc_messages"])) / float(
                d.get("interval_s") or 1.0)}
        d = {"subscribe_infos": 0.0, "moved_types": 0.0, **d}  # recorded without switches
        if "unsubscribe_infos" not in d:
            # recorded by a controller that held every message for the whole switch, with
            # one count for both directions: half each, which is the measured mean cost
            both = float(d["subscribe_infos"])
            d = {**d, "subscribe_infos": both / 2, "unsubscribe_infos": both / 2,
                 "held_share": 1.0}
        try:
            kw: dict[str, Any] = {f.name: (np.asarray(d[f.name], np.float64)
                                           if f.type == "np.ndarray" else float(d[f.name]))
                                  for f in fields(cls)}
            return cls(**kw)
        except (KeyError, TypeError, ValueError) as e:
            raise DSMDError(f"delay load: {type(e).__name__}: {e}") from None


def delivery_share(inst: Any, mask: np.ndarray) -> float:
    """The share of an instance's deliveries (messages times destinations) that belong to
    the types in ``mask`` (over ``inst``'s types): a load's ``held_share`` when ``mask`` is
    the types a switch moved."""
    per = np.asarray(inst.messages, np.float64) * np.diff(inst.dest_ptr)
    total = float(per.sum())
    return float(per[np.asarray(mask, bool)].sum()) / total if total > 0 else 0.0


@dataclass(frozen=True)
class ResourceQueue:
    """One resource's constants: ``kappa`` (burstiness, Kingman's ``(c_a^2 + c_s^2) / 2``),
    ``scale`` (wire bits per modelled bit, ``a_r``) and ``wait_exponent`` (``gamma``: a
    message waits with probability ``rho ** gamma``; 1 for a Poisson stream, below 1 where
    messages arrive in batches and all but a batch's first wait)."""

    kappa: float = 1.0
    scale: float = 1.0
    wait_exponent: float = 1.0

    def __post_init__(self) -> None:
        for k in ("kappa", "scale", "wait_exponent"):
            v = getattr(self, k)
            if isinstance(v, bool) or not isinstance(v, int | float) or not np.isfinite(v) \
                    or v <= 0:
                raise DSMDError(f"delay model: {k} must be a finite number > 0, got {v!r}")


@dataclass(frozen=True)
class DelayModel:
    """The delay model's constants (module docstring); :meth:`quantiles` scores a load."""

    base_s: float = 0.02
    controller_bw: ResourceQueue = field(default_factory=ResourceQueue)
    controller_cpu: ResourceQueue = field(default_factory=ResourceQueue)
    node: ResourceQueue = field(default_factory=ResourceQueue)
    control_wire_bps_per_node: float = 0.0
    calibration_scale: float = 1.0
    node_control_bps: float = 0.0
    cpu_service_s: float = 0.005
    rho_max: float = 0.95
    # a switch's time per subscribing and per unsubscribing SubscribeInfo and per moved
    # type (s), measured (envs/dsmd/switching_costs.json)
    hold_s_per_subscribe: float = 0.0
    hold_s_per_unsubscribe: float = 0.0
    hold_s_per_moved_type: float = 0.0
    fit: dict[str, Any] = field(default_factory=dict, compare=False)  # how it was calibrated

    def __post_init__(self) -> None:
        for k in ("base_s", "control_wire_bps_per_node", "node_control_bps", "cpu_service_s",
                  "hold_s_per_subscribe", "hold_s_per_unsubscribe", "hold_s_per_moved_type"):
            v = getattr(self, k)
            if isinstance(v, bool) or not isinstance(v, int | float) or not np.isfinite(v) \
                    or v < 0:
                raise DSMDError(f"delay model: {k} must be a finite number >= 0, got {v!r}")
        if not (isinstance(self.calibration_scale, int | float)
                and 0.0 < self.calibration_scale <= 1.0):
            raise DSMDError(f"delay model: calibration_scale must be in (0, 1], got "
                            f"{self.calibration_scale!r}")
        if not 0.0 < self.rho_max < 1.0:
            raise DSMDError(f"delay model: rho_max must be in (0, 1), got {self.rho_max!r}")

    # ------------------------------------------------------------------ persistence
    @classmethod
    def from_dict(cls, d: dict[str, Any], where: str = "delay model") -> DelayModel:
        if not isinstance(d, dict):
            raise DSMDError(f"{where}: expected a mapping, got {type(d).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise DSMDError(f"{where}: unknown keys {unknown}; expected some of {sorted(known)}")
        kw: dict[str, Any] = {}
        for k, v in d.items():
            if k in ("controller_bw", "controller_cpu", "node"):
                if not isinstance(v, dict) or set(v) - {"kappa", "scale", "wait_exponent"}:
                    raise DSMDError(f"{where}: {k} must be a mapping of kappa, scale and "
                                    f"wait_exponent, got {v!r}")
                kw[k] = ResourceQueue(**{kk: float(vv) for kk, vv in v.items()})
            elif k == "fit":
                kw[k] = dict(v)
            else:
                kw[k] = v
        try:
            return cls(**kw)
        except DSMDError as e:
            raise DSMDError(f"{where}: {e}".replace("delay model: ", "")) from None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    # ------------------------------------------------------------------ the model
    def _resource(self, q: ResourceQueue, load: np.ndarray, cap: np.ndarray,
                  service_s: np.ndarray, t: float, servers: float = 1.0
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """(rho, waiting probability, mean wait s, fluid span s) of one resource with
        ``servers`` servers (Kingman for one, Sakasegawa for more)."""
        rho = q.scale * load / np.maximum(cap, 1e-12)
        r = np.minimum(rho, self.rho_max)
        if servers <= 1.0:
            wait_p = r ** q.wait_exponent
            mean = q.kappa * r / (1.0 - r) * service_s
        else:
            wait_p = r ** (np.sqrt(2.0 * (servers + 1.0)) - 1.0)
            mean = q.kappa * wait_p / (servers * (1.0 - r)) * service_s
        wait_p = np.where(rho >= 1.0, 1.0, wait_p)
        return rho, wait_p, mean, np.maximum(rho - 1.0, 0.0) * t

    def terms(self, load: DelayLoad) -> dict[str, Any]:
        """Each resource's utilisation, waiting probability, mean wait and fluid span (s)."""
        n = load.node_load_bps.size
        ctl = load.controller_load_bps + self.control_wire_bps_per_node * n / (
            self.calibration_scale * self.controller_bw.scale)
        b = self._resource(self.controller_bw, np.array([ctl]),
                           np.array([load.controller_bw_bps]),
                           np.array([load.batch_dispersion * self.controller_bw.scale
                                     * load.mean_message_bits
                                     / max(load.controller_bw_bps, 1e-12)]), load.interval_s)
        c = max(load.controller_cpu, 1.0)
        p = self._resource(self.controller_cpu, np.array([load.send_rate * self.cpu_service_s]),
                           np.array([c]), np.array([self.cpu_service_s]), load.interval_s,
                           servers=c)
        s = self._resource(self.node, load.node_load_bps + self.node_control_bps
                           / self.node.scale, load.node_capacity_bps,
                           self.node.scale * load.mean_message_bits
                           / np.maximum(load.node_capacity_bps, 1e-12), load.interval_s)
        return {"bw": b, "cpu": p, "node": s}

    def quantiles(self, load: DelayLoad, qs: tuple[float, ...] = (0.5, 0.95)
                  ) -> dict[str, float]:
        """``delay_p50_s``, ``delay_p95_s`` (for ``qs``) of the interval's deliveries, each
        resource's utilisation (``bw_util``, ``cpu_util``, ``node_util_max``) and the
        switches' hold (``hold_s``) of the share ``held_share`` of the deliveries."""
        tm = self.terms(load)
        (rb, pb, wb, lb), (rp, pp, wp, lp), (rn, pn, wn, ln) = tm["bw"], tm["cpu"], tm["node"]
        # components: (node, RPC) and (node, MQ)
        w = np.concatenate([load.node_rpc_messages, load.node_mq_messages])
        keep = w > 0
        hold = self.hold_s(load)
        out = {"bw_util": float(rb[0]), "cpu_util": float(rp[0]),
               "node_util_max": float(rn.max(initial=0.0)), "hold_s": hold}
        if not keep.any():
            out.update({_qname(q): 0.0 for q in qs})
            return out
        zero = np.zeros_like(wn)
        mean = np.concatenate([wb[0] + wp[0] + wn, wb[0] + wn])[keep]
        prob = 1.0 - np.concatenate([(1 - pb[0]) * (1 - pp[0]) * (1 - pn),
                                     (1 - pb[0]) * (1 - pn) + zero])[keep]
        span = np.concatenate([lb[0] + lp[0] + ln, lb[0] + ln])[keep]
        w = w[keep] / w[keep].sum()
        for q in qs:
            out[_qname(q)] = self.base_s + _mixture_quantile(
                w, prob, mean, span, q, hold=hold, interval_s=load.interval_s,
                held_share=load.held_share)
        return out

    def hold_s(self, load: DelayLoad) -> float:
        """Seconds the interval's switches hold the messages they hold (module docstring),
        measured per SubscribeInfo each way and per moved type by
        ``bench/bench_switch_cost.py``."""
        return (self.hold_s_per_subscribe * load.subscribe_infos
                + self.hold_s_per_unsubscribe * load.unsubscribe_infos
                + self.hold_s_per_moved_type * load.moved_types)


def _qname(q: float) -> str:
    return f"delay_p{round(100 * q):d}_s"


def _cdf(x: float, prob: np.ndarray, mean: np.ndarray, span: np.ndarray) -> np.ndarray:
    """P(wait <= x) of each component: an exponential tail (waits with ``prob``, mean
    ``mean`` overall) plus an independent uniform fluid wait on ``[0, span]``."""
    theta = np.where(prob > 0, mean / np.maximum(prob, 1e-300), 0.0)
    tail = np.where(theta > 0, np.exp(-x / np.maximum(theta, 1e-300)), 0.0)
    plain = 1.0 - prob * tail
    u = np.minimum(x, span)
    safe_span = np.maximum(span, 1e-300)
    with np.errstate(over="ignore", invalid="ignore"):
        fluid = (u - prob * theta * (np.where(theta > 0, np.exp(-(x - u) / np.maximum(
            theta, 1e-300)), 0.0) - tail)) / safe_span
    return np.where(span > 0, np.clip(fluid, 0.0, 1.0), plain)


def _cdf_integral(y: float, prob: np.ndarray, mean: np.ndarray, span: np.ndarray
                  ) -> np.ndarray:
    """``G(y)``, the integral of :func:`_cdf` from 0 to ``y`` (0 for ``y <= 0``), in
    closed form for the exponential tail with and without the uniform fluid wait."""
    if y <= 0.0:
        return np.zeros_like(mean)
    theta = np.where(prob > 0, mean / np.maximum(prob, 1e-300), 0.0)
    th = np.maximum(theta, 1e-300)
    pt = prob * theta

    def ex(z: float | np.ndarray) -> np.ndarray:  # exp(-z / theta), 0 where theta is 0
        return np.where(theta > 0, np.exp(-np.asarray(z) / th), 0.0)

    def om(z: float | np.ndarray) -> np.ndarray:  # 1 - exp(-z / theta), without cancelling
        return np.where(theta > 0, -np.expm1(-np.asarray(z) / th), 1.0)

    plain = y - pt * om(y)
    s = np.where(span > 0, span, 1.0)  # the fluid branch only where there is a span
    below = (0.5 * y * y - pt * (y - theta * om(y))) / s
    at_s = (0.5 * span * span - pt * (span - theta * om(span))) / s
    above = at_s + (span * (y - span) - pt * (theta * om(np.maximum(y - span, 0.0))
                                              - theta * (ex(span) - ex(y)))) / s
    fluid = np.where(y <= span, below, above)
    out: np.ndarray = np.where(span > 0, fluid, plain)
    return out


def _cdf_held(x: float, prob: np.ndarray, mean: np.ndarray, span: np.ndarray, hold: float,
              interval_s: float) -> np.ndarray:
    """:func:`_cdf` of the wait plus the sending path's hold: the interval's switches hold
    the controller's dispatch for ``hold`` seconds at the start of the interval (the
    boundary's switch, then the placements of types on their first messages, which come
    early), so a message sent at ``t``, uniform over the interval ``T``, first waits
    ``max(0, hold - t)``; ``P(W + H <= x) = max(T - hold, 0) / T F(x) + (G(x - hold + m) -
    G(x - hold)) / T``, ``m = min(hold, T)``."""
    if hold <= 0.0:
        return _cdf(x, prob, mean, span)
    t = max(float(interval_s), 1e-9)
    m = min(hold, t)
    out: np.ndarray = (max(t - hold, 0.0) / t * _cdf(x, prob, mean, span)
                       + (_cdf_integral(x - hold + m, prob, mean, span)
                          - _cdf_integral(x - hold, prob, mean, span)) / t)
    return out


def _mixture_quantile(w: np.ndarray, prob: np.ndarray, mean: np.ndarray, span: np.ndarray,
                      q: float, iters: int = 60, hold: float = 0.0,
                      interval_s: float = 1.0, held_share: float = 1.0) -> float:
    """The ``q`` quantile of the weighted mixture (bisection on its CDF), with the share
    ``held_share`` of every component held ``hold`` seconds of the interval ``interval_s``
    (:func:`_cdf_held`)."""
    theta = np.where(prob > 0, mean / np.maximum(prob, 1e-300), 0.0)
    lo, hi = 0.0, float(span.max(initial=0.0) + 40.0 * theta.max(initial=0.0) + hold) + 1e-9
    if hold <= 0.0 or held_share <= 0.0:
        hold, held_share = 0.0, 1.0

    def cdf(x: float) -> np.ndarray:
        held = _cdf_held(x, prob, mean, span, hold, interval_s)
        if held_share >= 1.0:
            return held
        return held_share * held + (1.0 - held_share) * _cdf(x, prob, mean, span)

    if float(w @ cdf(0.0)) >= q:
        return 0.0
    for _ in range(iters):
        mid = 0.5 * (lo + hi)
        if float(w @ cdf(mid)) >= q:
            hi = mid
        else:
            lo = mid
        if hi - lo <= 1e-6 * max(hi, 1e-3):
            break
    return hi


def switching_seconds(path: str | Path | None = None) -> dict[str, float]:
    """The measured switching costs (``path``: default :data:`SWITCHING_COSTS`, written by
    ``bench/bench_switch_cost.py``): a switch's seconds per SubscribeInfo
    (``seconds_per_subscribe_info``, both ways together), per subscribing and per
    unsubscribing one (``seconds_per_subscribe``, ``seconds_per_unsubscribe``: the fit
    with the directions apart, ``fit.block_split``) and per moved type
    (``seconds_per_moved_type``); a clear error names the file and the key."""
    f = Path(path) if path is not None else SWITCHING_COSTS
    try:
        d = json.loads(f.read_text())
    except (OSError, ValueError) as e:
        raise DSMDError(f"switching costs {f}: {e}") from None
    if not isinstance(d, dict):
        raise DSMDError(f"switching costs {f}: expected a mapping")
    split = ((d.get("fit") or {}).get("block_split") or {}).get("coef") or {}
    found = {"seconds_per_subscribe_info": d.get("seconds_per_subscribe_info"),
             "seconds_per_moved_type": d.get("seconds_per_moved_type"),
             "seconds_per_subscribe": split.get("subscribe"),
             "seconds_per_unsubscribe": split.get("unsubscribe")}
    where = {"seconds_per_subscribe": "fit.block_split.coef.subscribe",
             "seconds_per_unsubscribe": "fit.block_split.coef.unsubscribe"}
    vals = {}
    for k, v in found.items():
        if isinstance(v, bool) or not isinstance(v, int | float) or not np.isfinite(v) \
                or v < 0:
            raise DSMDError(f"switching costs {f}: {where.get(k, k)} must be seconds >= 0, "
                            f"got {v!r}")
        vals[k] = float(v)
    return vals


def measured_hold(path: str | Path | None = None) -> dict[str, float]:
    """:class:`DelayModel`'s hold constants from the measured switching costs."""
    sw = switching_seconds(path)
    return {"hold_s_per_subscribe": sw["seconds_per_subscribe"],
            "hold_s_per_unsubscribe": sw["seconds_per_unsubscribe"],
            "hold_s_per_moved_type": sw["seconds_per_moved_type"]}


def load_delay_model(path: str | Path | None = None) -> DelayModel:
    """The constants in ``path`` (default :data:`DELAY_MODEL`); a clear error names the file
    and the field that is wrong."""
    f = Path(path) if path is not None else DELAY_MODEL
    try:
        key = (str(f.resolve()), f.stat().st_mtime_ns)
        if key in _LOADED:
            return _LOADED[key]
        d = json.loads(f.read_text())
    except (OSError, ValueError) as e:
        raise DSMDError(f"delay model {f}: {e}") from None
    if isinstance(d, dict):
        d = d.get("model", d)
    model = DelayModel.from_dict(d, where=f"delay model {f}")
    _LOADED[key] = model
    return model


_LOADED: dict[tuple[str, int], DelayModel] = {}


# ---------------------------------------------------------------------- calibration
@dataclass(frozen=True)
class DelaySample:
    """One testbed run for the fit: its decisions' loads against the run's capacities (model
    units), the measured p50 and p95 (s) and the idle control traffic (wire bit/s)."""

    run: str
    resource: str
    loads: tuple[DelayLoad, ...]
    measured_p50_s: float
    measured_p95_s: float
    idle_bps: float
    capacity_scale: float
    wire_util: float


def testbed_sample(row: dict[str, Any], loads: list[dict[str, Any]], run: str, resource: str,
                   controller_bps: float | None = None, node_bps: float | None = None
                   ) -> DelaySample:
    """A :class:`DelaySample` from a testbed run's summary row (``delivery.testbed``) and its
    ``delay_loads.json``. ``controller_bps`` / ``node_bps``: the run's shaped capacities on
    the wire (default: the scenario's, scaled like the traffic)."""
    try:
        scale = float(row["payload_scale"]) / float(row["time_scale"])
        lds = [DelayLoad.from_dict(d) for d in loads]
        if not lds:
            raise DSMDError(f"testbed run {run}: no delay loads")
        if not any(ld.subscribe_infos for ld in lds) and float(row.get("subscribe_infos")
                                                              or 0.0) > 0:
            # recorded without the switches per interval: the run's, spread evenly
            per = float(row["subscribe_infos"]) / len(lds)
            lds = [ld.with_switches(per, ld.moved_types) for ld in lds]
        cb = controller_bps if controller_bps is not None else lds[0].controller_bw_bps * scale
        sn = node_bps
        lds = [ld.with_capacities(controller_bw_bps=cb / scale,
                                  node_capacity_bps=None if sn is None else sn / scale)
               for ld in lds]
        wall = float(row["wall_s"])
        if resource == "node":
            cap = sn if sn is not None else float(lds[0].node_capacity_bps.max()) * scale
            wire = 8.0 * float(row.get("link_node_bytes_max", 0.0)) / wall / cap
        else:
            wire = 8.0 * float(row.get("link_controller_bytes", 0.0)) / wall / cb
        return DelaySample(run, resource, tuple(lds), float(row["delay_p50_ms"]) / 1e3,
                           float(row["delay_p95_ms"]) / 1e3,
                           float(row.get("link_idle_bps", 0.0) or 0.0), scale, wire)
    except KeyError as e:
        raise DSMDError(f"testbed run {run}: its summary has no {e.args[0]!r}") from None


def predict_sample(model: DelayModel, s: DelaySample) -> dict[str, float]:
    """The model's p50 and p95 of a run: the mean over its decisions' intervals."""
    qs = [model.quantiles(ld) for ld in s.loads]
    return {k: float(np.mean([q[k] for q in qs])) for k in qs[0]}


# the nodes' wire scale is not fitted: one workload's node load and the nodes' control
# traffic are not separately identified (the controller's control traffic is measured)
_FREE = ("base_s", "bw_kappa", "bw_scale", "bw_gamma", "node_kappa", "node_gamma",
         "node_control_bps")


def _with(model: DelayModel, x: np.ndarray) -> DelayModel:
    v = dict(zip(_FREE, np.exp(x).tolist()))
    return replace(model, base_s=v["base_s"], node_control_bps=v["node_control_bps"],
                   # wire bits per modelled bit: at least 1 (framing only adds)
                   controller_bw=ResourceQueue(v["bw_kappa"], max(v["bw_scale"], 1.0),
                                               min(v["bw_gamma"], 1.0)),
                   node=ResourceQueue(v["node_kappa"], model.node.scale,
                                      min(v["node_gamma"], 1.0)))


def fit_delay_model(samples: list[DelaySample], start: DelayModel | None = None
                    ) -> tuple[DelayModel, dict[str, Any]]:
    """Fit ``base_s``, the burstiness and wait exponent of ``C_b`` and ``s(n)``, the wire
    scale of ``C_b`` and the nodes' control traffic to the measured p50 and p95 (least
    squares in log space, Nelder-Mead on log constants from a few starts). The controller's
    control traffic is the median measured idle rate per agent, on the wire. Returns the
    model and a report: each run's utilisation, measured and predicted delays, the RMS log
    errors, how many p95s are within a factor of 2, and Spearman's rho of the p95s."""
    from scipy.optimize import minimize
    from scipy.stats import spearmanr

    if not samples:
        raise DSMDError("no testbed runs to fit the delay model on")
    m0 = start or DelayModel()
    n = samples[0].loads[0].node_load_bps.size
    idle = [s.idle_bps / max(n, 1) for s in samples if s.idle_bps > 0]
    m0 = replace(m0, control_wire_bps_per_node=float(np.median(idle)) if idle else 0.0,
                 calibration_scale=float(np.median([s.capacity_scale for s in samples])))
    y50 = np.log(np.array([max(s.measured_p50_s, 1e-4) for s in samples]))
    y95 = np.log(np.array([max(s.measured_p95_s, 1e-4) for s in samples]))

    def loss(x: np.ndarray) -> float:
        m = _with(m0, x)
        p = [predict_sample(m, s) for s in samples]
        e50 = np.log([max(q["delay_p50_s"], 1e-4) for q in p]) - y50
        e95 = np.log([max(q["delay_p95_s"], 1e-4) for q in p]) - y95
        return float(np.sum(e50 ** 2) + np.sum(e95 ** 2))

    x0 = np.log([max(m0.base_s, 1e-3), m0.controller_bw.kappa, m0.controller_bw.scale,
                 m0.controller_bw.wait_exponent, m0.node.kappa, m0.node.wait_exponent,
                 max(m0.node_control_bps, 1e5)])
    best = None
    # a few starts: the loss has plateaus (nothing queues; or every message waits)
    for k0, g0, b0, c0 in ((10.0, 0.5, 0.02, 1e6), (40.0, 0.3, 0.02, 1e6),
                           (100.0, 0.9, 0.1, 1e5), (20.0, 0.7, 0.03, 5e6)):
        x = x0.copy()
        x[0] = np.log(b0)
        x[1] = x[4] = np.log(k0)
        x[3] = x[5] = np.log(g0)
        x[6] = np.log(c0)  # 1e6: 10 kbit/s on a testbed node's wire
        r = minimize(loss, x, method="Nelder-Mead",
                     options={"maxiter": 1500, "xatol": 1e-3, "fatol": 1e-4})
        if best is None or r.fun < best.fun:
            best = r
    assert best is not None
    polish = minimize(loss, best.x, method="Nelder-Mead",  # a fresh simplex at the best
                      options={"maxiter": 1500, "xatol": 1e-4, "fatol": 1e-5})
    if polish.fun < best.fun:
        best = polish
    model = _with(m0, best.x)
    runs = []
    for s in samples:
        p = predict_sample(model, s)
        util = p["node_util_max"] if s.resource == "node" else p["bw_util"]
        runs.append({"run": s.run, "resource": s.resource, "util": util,
                     "wire_util": s.wire_util, "measured_p50_s": s.measured_p50_s,
                     "predicted_p50_s": p["delay_p50_s"], "measured_p95_s": s.measured_p95_s,
                     "predicted_p95_s": p["delay_p95_s"]})
    m95 = np.array([r["measured_p95_s"] for r in runs])
    p95 = np.array([r["predicted_p95_s"] for r in runs])
    m50 = np.array([r["measured_p50_s"] for r in runs])
    p50 = np.array([r["predicted_p50_s"] for r in runs])
    ratio = p95 / np.maximum(m95, 1e-9)
    rho = spearmanr(m95, p95).statistic if len(runs) > 2 else float("nan")
    report = {"runs": runs, "loss": float(best.fun),
              "rms_log_p50": float(np.sqrt(np.mean(np.log(p50 / np.maximum(m50, 1e-9)) ** 2))),
              "rms_log_p95": float(np.sqrt(np.mean(np.log(ratio) ** 2))),
              "within_2x_p95": int(np.sum((ratio >= 0.5) & (ratio <= 2.0))),
              "spearman_p95": float(rho)}
    model = replace(model, fit={k: v for k, v in report.items() if k != "runs"}
                    | {"runs": len(runs), "bench": "bench/bench_delay.py"})
    return model, report
