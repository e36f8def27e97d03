"""The control-channel shaping sub-problem (Sincon, Yoo et al.).

* :mod:`envs.shaping.sincon`: the adaptive limit calculator (Section III-A) and the
  delay-based channel shaper (Section III-B), the no-shaping and static-split policies.
* :mod:`envs.shaping.simulator`: control channels of tenants' virtual switches sharing one
  link (queues, bursts, flow setups; Figs. 5-6's measurements).
* :mod:`envs.shaping.hypervisor`: the alternative shared resource (``server="hypervisor"``):
  the network hypervisor's I/O threads processing each channel's buffered batch per visit.
* :mod:`envs.shaping.env`: ``smart/Shaping-v0``, per-channel limits set by an agent.

The real asyncio shaper on byte streams is :mod:`delivery.shaper`.
"""

from .simulator import ShapingSimulator, SimConfig, SimResult, simulate
from .sincon import AdaptiveLimitCalculator, ChannelShaper, ShaperConfig, ShapingError, SinconConfig

__all__ = [
                     "AdaptiveLimitCalculator",
                     "ChannelShaper",
                     "ShaperConfig",
                     "ShapingError",
                     "ShapingSimulator",
                     "SimConfig",
                     "SimResult",
                     "SinconConfig",
                     "simulate",
]
