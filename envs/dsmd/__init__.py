"""The DSMD simulator (SMART paper, Sections IV-V): traces, parser, instance, cost model,
observation and reward. Everything here except :mod:`envs.dsmd.env` is gymnasium-free."""

from .cost import CostState, Metrics, evaluate
from .errors import DSMDError, InstanceError, TopologyError, TraceError
from .instance import RPC, UNASSIGNED, DSMDInstance
from .observation import ObservationBuilder, ObservationLayout
from .parser import MessageParser, ParsedTrace, TypeCatalog, destination_key, parse_trace
from .problems import ProblemSet, build_problems, problems_for
from .reward import RewardConfig, eq2_terms
from .scenarios import ScenarioSpec, generate, load_scenario
from .topology import Topology
from .traces import Dataset, Trace, read_dataset, read_trace, write_dataset, write_trace

__all__ = [
    "CostState", "Metrics", "evaluate", "DSMDError", "InstanceError", "TopologyError",
    "TraceError", "RPC", "UNASSIGNED", "DSMDInstance", "ObservationBuilder",
    "ObservationLayout", "MessageParser", "ParsedTrace", "TypeCatalog", "destination_key",
    "parse_trace", "ProblemSet", "build_problems", "problems_for", "RewardConfig",
    "eq2_terms", "ScenarioSpec", "generate", "load_scenario", "Topology", "Dataset", "Trace",
    "read_dataset", "read_trace", "write_dataset", "write_trace",
]
