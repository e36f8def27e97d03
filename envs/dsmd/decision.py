"""One decision step (SMART Section V-D): observe the type being decided, score its channels,
decode the scores to a channel, move the type there.

:class:`DecisionStep` is the only place that sequence is written: ``smart/DSMD-v0``
(:class:`envs.dsmd.env.DSMDEnv`), a learned policy's evaluation
(:class:`agents.learned.ActorPolicy`) and the policy server
(:class:`serving.session.Session`) are thin loops over it, so a policy is trained, evaluated
and served on the same observations and decoded the same way. A step owns

* the :class:`~envs.dsmd.cost.CostState` (the assignment and Eq. 1's quantities),
* the :class:`~envs.dsmd.observation.ObservationBuilder` of the policy's layout (none when a
  heuristic scores),
* the decision order (:func:`decision_order`, or the types a caller lists) and a cursor in it,
* the RNG that breaks decoding ties (:mod:`envs.dsmd.decoding`).

A sequential decision is ``obs = step.observe()`` (the next type of the order is taken off its
channel if it is on one, then observed), ``c = step.apply(policy(obs))`` (decode, move, tell the
builder). Each half is one compiled call (:func:`envs.dsmd.kernels.observe_next` for the
``channel`` observation, :func:`envs.dsmd.kernels.decide_next`), equal to the step-by-step
``CostState.move``, ``ObservationBuilder.observe`` and :func:`envs.dsmd.decoding.decode` it
stands for. A batch decided at once, all from the state in which its types are undecided
(the policy server's ``parallel`` mode), is :meth:`DecisionStep.take_off_many`,
:meth:`DecisionStep.rows` (the observations, filled chunk by chunk by the scorer) and
:meth:`DecisionStep.apply_rows` (row-wise argmax with the ``feasible`` safety layer).

Progress (the ``channel`` observation's ``progress`` global) is the share of the instance's
types that are decided (``progress="decided"``): ``i / n`` before the i-th decision of a
sequence from an empty assignment. ``progress="step"`` is the position in the order instead,
for an episode that starts with every type assigned and re-decides each
(``DSMDEnv(initial="rpc")``).

This module does not import gymnasium.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from . import kernels as _k
from .cost import CostState
from .decoding import check_decoding, decode, decode_action, decode_actions
from .errors import DSMDError
from .instance import UNASSIGNED, DSMDInstance
from .observation import ObservationBuilder, ObservationLayout

__all__ = ["ORDERS", "PROGRESS", "DecisionStep", "decision_order"]

ORDERS: tuple[str, ...] = ("rate_desc", "random", "index")
PROGRESS: tuple[str, ...] = ("decided", "step")
_F32 = np.dtype(np.float32)


def decision_order(inst: DSMDInstance, order: str, rng: np.random.Generator | None = None
                   ) -> np.ndarray:
    """The sequence in which an episode decides the types of ``inst``: ``rate_desc`` (largest
    ``f(m)|D(m)|`` first, ties by index), ``index`` or ``random`` (a permutation drawn from
    ``rng``)."""
    if order == "rate_desc":
        return np.argsort(-(inst.rate_bps * inst.fanout), kind="stable")
    if order == "index":
        return np.arange(inst.num_types)
    if order == "random":
        if rng is None:
            raise DSMDError("order='random' needs an RNG")
        return rng.permutation(inst.num_types)
    raise DSMDError(f"order must be one of {ORDERS}, got {order!r}")


def _checked_order(order: Sequence[int] | np.ndarray, num_types: int
                   ) -> Sequence[int] | np.ndarray:
    """``order`` if every entry is an instance index, 0 <= m < ``num_types`` (the compiled
    steps index with them unchecked); else a :class:`DSMDError`."""
    if len(order):
        lo, hi = ((int(order.min()), int(order.max())) if isinstance(order, np.ndarray)
                  else (min(order), max(order)))
        if lo < 0 or hi >= num_types:
            raise DSMDError(f"decision order: type {lo if lo < 0 else hi} is not in "
                            f"0..{num_types - 1}")
    return order


class DecisionStep:
    """The state of a sequence of channel decisions over one instance (module docstring).

    ``layout``: the observation layout of the policy that scores (``None``: no observations,
    e.g. a heuristic scores; :meth:`use_layout` sets one later). ``order``: a mode of
    :func:`decision_order` (drawn from ``rng`` for ``random``) or the instance indices to
    decide, in order. ``state``: the assignment to start from (default: every type
    unassigned); the step moves it in place.
    """

    __slots__ = (
        "_by_step",
        "_k1",
        "_n",
        "_out_ok",
        "builder",
        "cursor",
        "decoding",
        "inst",
        "order",
        "rng",
        "state",
    )

    def __init__(self, inst: DSMDInstance, layout: ObservationLayout | None = None, *,
                 rng: np.random.Generator, order: str | Sequence[int] | np.ndarray = "rate_desc",
                 decoding: str = "argmax", state: CostState | None = None,
                 progress: str = "decided") -> None:
        if progress not in PROGRESS:
            raise DSMDError(f"progress must be one of {PROGRESS}, got {progress!r}")
        self.inst = inst
        self.state = state if state is not None else CostState(inst)
        self.rng = rng
        self.decoding = check_decoding(decoding)
        self.builder: ObservationBuilder | None = None
        if layout is not None:
            self.use_layout(layout)
        self.order: Sequence[int] | np.ndarray = (decision_order(inst, order, rng)
                                                  if isinstance(order, str)
                                                  else _checked_order(order, inst.num_types))
        self.cursor = 0
        self._by_step = progress == "step"
        self._n = max(inst.num_types, 1)
        self._k1 = inst.num_topics + 1
        #: the last out= buffer found fit, and the builder it was found fit for
        self._out_ok: tuple[np.ndarray, ObservationBuilder] | None = None

    # ------------------------------------------------------------------ the order
    def begin(self, order: Sequence[int] | np.ndarray, *, checked: bool = False) -> None:
        """Decide the instance indices ``order`` next, in that order (``checked``: the caller
        vouches that each is in 0..M-1, as the session's own positions are)."""
        self.order = order if checked else _checked_order(order, self.inst.num_types)
        self.cursor = 0

    @property
    def next_type(self) -> int | None:
        """The instance index the next :meth:`apply` decides (None when the order is done)."""
        return int(self.order[self.cursor]) if self.cursor < len(self.order) else None

    @property
    def done(self) -> bool:
        return self.cursor >= len(self.order)

    def progress(self) -> float:
        """Decided types / all types (``progress="decided"``), or the position in the order /
        its length (``"step"``)."""
        if self._by_step:
            return self.cursor / len(self.order)
        return self.state.assigned / self._n

    # ------------------------------------------------------------------ observations
    def use_layout(self, layout: ObservationLayout) -> ObservationBuilder:
        """The builder of ``layout`` (built from the current state unless the step already
        keeps one of an equal layout)."""
        b = self.builder
        if b is None or (b.layout is not layout and b.layout != layout):
            b = self.builder = ObservationBuilder(layout, self.inst)
            b.reset(self.state)
        return b

    def drop_builder(self) -> None:
        """Forget the builder (after the state changed other than through this step's moves;
        :meth:`use_layout` builds a new one)."""
        self.builder = None

    def take_off(self) -> None:
        """Take the next type off its channel if it is on one (it is then decided given every
        other type)."""
        m = self.next_type
        if m is not None and self.state.channel[m] != UNASSIGNED:
            self.state.move(m, UNASSIGNED)
            if self.builder is not None:
                self.builder.on_move(m, UNASSIGNED)

    def observe(self, out: np.ndarray | None = None) -> np.ndarray:
        """The observation before deciding the next type (after the last one: the final
        state's), with that type first taken off its channel (:meth:`take_off`). ``out``: a
        float32 buffer of the layout's size to write it into and return (default: a new
        array). For the ``channel`` layout, taking off and observing are one compiled call
        (:func:`envs.dsmd.kernels.observe_next`)."""
        # take_off() and progress() inlined: this runs once per decision
        order, i, state, b = self.order, self.cursor, self.state, self.builder
        if b is None:
            raise DSMDError("DecisionStep.observe needs an observation layout (use_layout)")
        m = int(order[i]) if i < len(order) else None
        if b.compiled:
            buf = b.buffer
            if out is not None:  # the compiled call writes it unchecked (checked once)
                ok = self._out_ok
                if ok is None or ok[0] is not out or ok[1] is not b:
                    if (out.__class__ is not np.ndarray or out.dtype is not _F32
                            or out.shape != buf.shape or not out.flags.c_contiguous):
                        raise DSMDError(f"observe(out=...) needs a contiguous float32 array "
                                        f"of shape {buf.shape}")
                    self._out_ok = (out, b)
                buf = out
            if _k.observe_next(-1 if m is None else m, buf, *state.moving_arrays(),
                               i / len(order) if self._by_step else -1.0,  # type: ignore[call-arg]
                               b.seen, b.blocks):
                state.version += 1
            return buf.copy() if out is None else buf
        if m is not None and state.channel[m] != UNASSIGNED:
            state.move(m, UNASSIGNED)
            b.on_move(m, UNASSIGNED)
        progress = i / len(order) if self._by_step else state.assigned / self._n
        obs = b.observe(state, m, progress)
        if out is None:
            return obs
        out[:] = obs
        return out

    # ------------------------------------------------------------------ decisions
    def apply(self, scores: np.ndarray, decoding: str | None = None) -> int:
        """Decode ``scores`` (one per channel) for the next type with ``decoding`` (default:
        the step's), move it there and advance; returns the channel. Decoding and moving are
        one compiled call (:func:`envs.dsmd.kernels.decide_next`, the same channel as
        :func:`envs.dsmd.decoding.decode` and the same draws from the RNG)."""
        m = int(self.order[self.cursor])
        state = self.state
        mode = decoding or self.decoding
        # a contiguous float32 row (a policy's output) as it is, anything else as_scores'd
        a = (scores if scores.__class__ is np.ndarray and scores.dtype is _F32
             and scores.ndim == 1 and scores.flags.c_contiguous else _k.as_scores(scores))
        if a.shape[0] == self._k1:
            feasible = mode != "argmax"
            if feasible and state.pending_node is None:
                state.track_pending()
            args = state.moving_arrays()
            c = _k.decide_next(m, a, -1, feasible, *args)
            if c < UNASSIGNED:  # several channels tie for the best score: draw one
                c = _k.decide_next(m, a, decode_action(a, self.rng), feasible, *args)
            state.version += 1
        else:  # scores of another width: the checked path says what is wrong
            c = decode(scores, state, m, self.rng, mode)
            state.move(m, c)
        b = self.builder
        if b is not None and not b.compiled:
            b.on_move(m, c)
        self.cursor += 1
        return c

    def apply_channel(self, c: int) -> int:
        """Put the next type on channel ``c`` as chosen (a discrete action) and advance."""
        m = int(self.order[self.cursor])
        c = int(c)
        self.state.move(m, c)
        if self.builder is not None:
            self.builder.on_move(m, c)
        self.cursor += 1
        return c

    # ------------------------------------------------------------------ a batch at once
    def take_off_many(self, ms: np.ndarray) -> None:
        """Take the types ``ms`` off their channels together."""
        ch = self.state.channel
        if ms.size and np.any(ch[ms] != UNASSIGNED):
            ch = ch.copy()
            ch[ms] = UNASSIGNED
            self.state.assign_all(ch)
            self.builder = None

    def rows(self, ms: np.ndarray, layout: ObservationLayout
             ) -> Callable[[int, int, np.ndarray], None]:
        """``fill(lo, hi, out)``: the observations of the undecided types ``ms[lo:hi]``, each
        as if it were the next to be decided (:meth:`ObservationBuilder.rows`, equal row by
        row to :meth:`observe`)."""
        return self.use_layout(layout).rows(self.state, ms, self.progress())

    def apply_rows(self, ms: np.ndarray, scores: np.ndarray, decoding: str) -> np.ndarray:
        """Channels for the undecided types ``ms`` from their ``[len(ms), K+1]`` scores, applied
        together: each row's argmax (ties drawn row by row). With ``feasible`` decoding, if that
        breaks a constraint, the types are decoded one by one in order with the same scores
        (the safety layer, :func:`~envs.dsmd.decoding.decode`), so the batch ends feasible
        whenever one-by-one decoding would. Returns the chosen channels."""
        state = self.state
        best = decode_actions(scores, self.rng)
        # room on the controller for the first type, in the state without the batch (the
        # state the safety layer would start from)
        room = decoding == "feasible" and state.topic_room(int(ms[0]), reserve=True)
        ch = state.channel.copy()
        ch[ms] = best
        state.assign_all(ch)
        # without that room, none of them has any (what the unplaced types reserve plus
        # what is placed only grows), so decode() would give each its argmax, as above
        if room and not state.metrics().feasible:
            ch[ms] = UNASSIGNED
            state.assign_all(ch)
            for i, p in enumerate(ms.tolist()):
                c = decode(scores[i], state, p, self.rng, "feasible")
                state.move(p, c)
                ch[p] = c
        self.builder = None
        chosen: np.ndarray = ch[ms]
        return chosen
