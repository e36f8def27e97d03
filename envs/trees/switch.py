"""The software-switch model of Section IV (Optimal Multicast, Zhu, Niu, Li, Li).

A switch that receives one stream at rate ``r`` (Gbps) and clones it onto ``d`` output
ports sends each copy at

    f(d, r) = min(g(d), r)            (Section IV, the model read off Fig. 3)

and in total ``U(d, r) = d f(d, r)``, with ``g`` positive and decreasing and ``d g(d)``
increasing and concave (Fig. 4). ``U(0, r) = 0``.

The paper's profile curves are not published as numbers. Two sources of ``g`` are provided:

* :class:`CloningCostSwitch`: a CPU cost per input packet plus a cost per copy, so a switch
  that clones a saturating input onto ``d`` ports sends each copy at
  ``g(d) = g1 (1 + rho) / (rho + d)`` (``rho`` = per-packet / per-copy cost). It is fitted to
  the facts the paper cites (Section II, from Emmerich et al. [7]: the per-stream packet rate
  drops by 30 % when a flow is sent out twice and by another 25 % when it is copied once
  more; Section IV: the input saturates near 0.8 Gbps, so ``g(1) = 0.8``). "Another 25 %" is
  read relative to the two-copy rate: ``g(2)/g(1) = 0.70``, ``g(3)/g(1) = 0.525``.
  :func:`fit_cloning_cost` takes ``rho`` by least squares on ``log(g(d)/g(1))``:
  ``rho = 1.246``, giving ``g(2)/g(1) = 0.692`` and ``g(3)/g(1) = 0.529`` (within 1.2 % and
  0.8 % of the facts). ``g`` decreases and ``d g(d)`` increases and is concave, approaching
  the CPU's cap ``g1 (1 + rho) = 1.80`` Gbps (Fig. 6: the total output stops growing with
  the input rate, at a cap that grows with ``d``). Rejected forms: a power law
  ``g1 d^-b`` (best ``b = 0.566`` misses the facts by 3.5 % and keeps ~40 Mbps per copy at
  ``d = 200``, no CPU cap); ``g1 (1 + a(d-1))^-b`` hits both facts exactly only with
  ``b = 1.49 > 1``, so ``d g(d)`` would fall for large ``d``, contradicting Fig. 4.
* :class:`ProfileSwitch`: ``g`` from a table ``d, g_gbps`` (:func:`load_profile`), validated
  (consecutive degrees from 1, positive, non-increasing ``g``, non-decreasing ``d g(d)``).
  Beyond the table's last degree ``D_max`` the total output is held at its last value
  (``g(d) = D_max g(D_max) / d``), which keeps every property above. ``profiles/`` holds the
  parametric fit's table and, where one was measured, a real switch profile
  (``scripts/profile_switch.py``).

Rates are in Gbps throughout. This module does not import gymnasium.
"""

from __future__ import annotations

import abc
import csv
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol, runtime_checkable

import numpy as np

from .errors import MulticastError

__all__ = [
    "PAPER_FACTS",
    "PROFILES_DIR",
    "CloningCostSwitch",
    "ProfileSwitch",
    "SwitchModel",
    "fit_cloning_cost",
    "load_profile",
    "switch_from_spec",
    "validate_profile",
    "write_profile",
]

PROFILES_DIR = Path(__file__).resolve().parent / "profiles"

#: (out degree d, g(d) / g(1)) as cited in Section II of the paper (from [7]).
PAPER_FACTS: tuple[tuple[int, float], ...] = ((1, 1.0), (2, 0.70), (3, 0.70 * 0.75))

#: the input rate (Gbps) at which the paper's profiled OvS saturates (Section IV).
PAPER_G1_GBPS = 0.8


@runtime_checkable
class SwitchModel(Protocol):
    """What the solver and the tree evaluator need of a switch."""

    def g(self, d: int) -> float:
        """Per-stream output rate (Gbps) with ``d >= 1`` copies of a saturating input."""

    def f(self, d: int, r: float) -> float:
        """Per-stream output rate f(d, r) = min(g(d), r)."""

    def U(self, d: int, r: float) -> float:
        """Total output rate U(d, r) = d f(d, r)."""

    def g_many(self, d: np.ndarray) -> np.ndarray:
        """``g`` over an array of degrees."""


class _SwitchBase(abc.ABC):
    """f and U from g (Section IV), with argument checks."""

    @abc.abstractmethod
    def g(self, d: int) -> float:
        """Per-copy output rate at out degree ``d``."""

    def f(self, d: int, r: float) -> float:
        if r < 0 or not math.isfinite(r):
            raise MulticastError(f"switch input rate r must be finite and >= 0, got {r}")
        if d < 0:
            raise MulticastError(f"switch out degree d must be >= 0, got {d}")
        if d == 0:
            return 0.0
        return min(self.g(int(d)), float(r))

    def U(self, d: int, r: float) -> float:
        return int(d) * self.f(d, r)

    def g_many(self, d: np.ndarray) -> np.ndarray:
        """``g`` over an array of degrees (Algorithm 1 evaluates it for every k)."""
        return np.array([self.g(int(x)) for x in np.asarray(d).ravel()], dtype=float)

    def table(self, max_degree: int) -> np.ndarray:
        """``g(1..max_degree)`` as an array."""
        return np.array([self.g(d) for d in range(1, max_degree + 1)], dtype=float)


def fit_cloning_cost(facts: Sequence[tuple[int, float]] = PAPER_FACTS) -> float:
    """Least-squares ``rho`` of ``g(d)/g(1) = (1 + rho)/(rho + d)`` over ``(d, ratio)``
    facts (in log space)."""
    from scipy.optimize import minimize_scalar

    if not any(d > 1 for d, _ in facts):
        raise MulticastError("fit_cloning_cost needs at least one fact with d > 1")
    target = [(d, math.log(v)) for d, v in facts]

    def loss(rho: float) -> float:
        return sum((math.log((1 + rho) / (d + rho)) - lv) ** 2 for d, lv in target)

    return float(minimize_scalar(loss, bounds=(1e-6, 1e3), method="bounded",
                                 options={"xatol": 1e-9}).x)


@dataclass(frozen=True)
class CloningCostSwitch(_SwitchBase):
    """``g(d) = g1 (1 + rho) / (rho + d)``; defaults: the fit to the paper's cited facts."""

    g1: float = PAPER_G1_GBPS
    rho: float = field(default_factory=fit_cloning_cost)

    def __post_init__(self) -> None:
        if not (self.g1 > 0 and math.isfinite(self.g1)):
            raise MulticastError(f"CloningCostSwitch.g1 must be a positive rate, got {self.g1}")
        if not (self.rho > 0 and math.isfinite(self.rho)):
            raise MulticastError(f"CloningCostSwitch.rho must be > 0, got {self.rho}")

    def g(self, d: int) -> float:
        if d < 1:
            raise MulticastError(f"g(d) needs d >= 1, got {d}")
        return self.g1 * (1.0 + self.rho) / (self.rho + d)

    def g_many(self, d: np.ndarray) -> np.ndarray:
        d = np.asarray(d, dtype=float)
        if d.size and d.min() < 1:
            raise MulticastError(f"g(d) needs d >= 1, got {d.min()}")
        return self.g1 * (1.0 + self.rho) / (self.rho + d)


@dataclass(frozen=True)
class ProfileSwitch(_SwitchBase):
    """``g`` from a measured or tabulated profile ``g_gbps[d - 1]`` (validated)."""

    g_gbps: tuple[float, ...]
    source: str = "<table>"

    def __post_init__(self) -> None:
        validate_profile(self.g_gbps, self.source)

    @property
    def max_degree(self) -> int:
        return len(self.g_gbps)

    @property
    def concave(self) -> bool:
        """Whether ``d g(d)`` is concave over the table (Theorem 1's assumption)."""
        u = np.arange(1, self.max_degree + 1) * np.asarray(self.g_gbps)
        u = np.concatenate([[0.0], u])
        return bool(np.all(np.diff(u, 2) <= 1e-12))

    def g(self, d: int) -> float:
        if d < 1:
            raise MulticastError(f"g(d) needs d >= 1, got {d}")
        if d <= self.max_degree:
            return float(self.g_gbps[d - 1])
        return self.max_degree * float(self.g_gbps[-1]) / d

    def g_many(self, d: np.ndarray) -> np.ndarray:
        d = np.asarray(d, dtype=np.int64)
        if d.size and d.min() < 1:
            raise MulticastError(f"g(d) needs d >= 1, got {d.min()}")
        tab = np.asarray(self.g_gbps, dtype=float)
        inside = d <= self.max_degree
        out = np.empty(d.shape, dtype=float)
        out[inside] = tab[d[inside] - 1]
        out[~inside] = self.max_degree * tab[-1] / d[~inside]
        return out


def validate_profile(g_gbps: Sequence[float], source: str = "<table>") -> None:
    """Refuse a profile that breaks Section IV's model, naming the row at fault."""
    if len(g_gbps) == 0:
        raise MulticastError(f"profile {source}: empty table")
    prev_g, prev_u = math.inf, 0.0
    for i, v in enumerate(g_gbps):
        d = i + 1
        if not (math.isfinite(v) and v > 0):
            raise MulticastError(f"profile {source}: g({d}) = {v} is not a positive rate")
        if v > prev_g * (1 + 1e-9):
            raise MulticastError(f"profile {source}: g must be non-increasing, but g({d}) = "
                                 f"{v} > g({d - 1}) = {prev_g}")
        if d * v < prev_u * (1 - 1e-9):
            raise MulticastError(f"profile {source}: the total output d g(d) must be "
                                 f"non-decreasing, but {d} g({d}) = {d * v:.6g} < "
                                 f"{d - 1} g({d - 1}) = {prev_u:.6g}")
        prev_g, prev_u = v, d * v


def load_profile(path: str | Path) -> ProfileSwitch:
    """A :class:`ProfileSwitch` from a CSV file with columns ``d,g_gbps`` (``#`` comments
    allowed), degrees 1, 2, ... in order."""
    path = Path(path)
    if not path.is_file():
        raise MulticastError(f"profile file {path} does not exist")
    rows = [ln for ln in path.read_text().splitlines() if ln.strip() and not
            ln.lstrip().startswith("#")]
    reader = csv.DictReader(rows)
    if reader.fieldnames is None or not {"d", "g_gbps"} <= set(reader.fieldnames):
        raise MulticastError(f"profile {path}: needs a header with columns d,g_gbps; got "
                             f"{reader.fieldnames}")
    values: list[float] = []
    for line, row in enumerate(reader, start=2):
        try:
            d, v = int(row["d"]), float(row["g_gbps"])
        except (TypeError, ValueError):
            raise MulticastError(f"profile {path}: row {line} ({row}) is not a number pair"
                                 ) from None
        if d != len(values) + 1:
            raise MulticastError(f"profile {path}: row {line} has d = {d}, expected "
                                 f"{len(values) + 1} (degrees 1, 2, ... in order)")
        values.append(v)
    return ProfileSwitch(tuple(values), source=str(path))


def write_profile(path: str | Path, g_gbps: Sequence[float], header: Sequence[str] = ()
                  ) -> Path:
    """Write a profile table (``# header`` lines, then ``d,g_gbps``)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = [f"# {h}" for h in header] + ["d,g_gbps"]
    lines += [f"{d},{v:.9g}" for d, v in enumerate(g_gbps, start=1)]
    path.write_text("\n".join(lines) + "\n")
    return path


def switch_from_spec(spec: str | SwitchModel | None) -> SwitchModel:
    """``None``/``"cloning_cost"``: the paper-fit parametric model; ``"profile:<name or path>"``: a
    table (a bare name is looked up in ``profiles/<name>.csv``); a model passes through."""
    if spec is None or spec == "cloning_cost":
        return CloningCostSwitch()
    if isinstance(spec, str):
        if spec.startswith("profile:"):
            name = spec[len("profile:"):]
            path = Path(name) if name.endswith(".csv") else PROFILES_DIR / f"{name}.csv"
            return load_profile(path)
        raise MulticastError(f"switch must be 'cloning_cost' or 'profile:<name>', got {spec!r}")
    if isinstance(spec, SwitchModel):
        return spec
    raise MulticastError(f"switch must be a name or a SwitchModel, got {type(spec).__name__}")
