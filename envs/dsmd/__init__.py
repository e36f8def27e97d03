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
    "RPC",
    "UNASSIGNED",
    "CostState",
    "DSMDError",
    "DSMDInstance",
    "Dataset",
    "InstanceError",
    "MessageParser",
    "Metrics",
    "ObservationBuilder",
    "ObservationLayout",
    "ParsedTrace",
    "ProblemSet",
    "RewardConfig",
    "ScenarioSpec",
    "Topology",
    "TopologyError",
    "Trace",
    "TraceError",
    "TypeCatalog",
    "build_problems",
    "destination_key",
    "eq2_terms",
    "evaluate",
    "generate",
    "load_scenario",
    "parse_trace",
    "problems_for",
    "read_dataset",
    "read_trace",
    "write_dataset",
    "write_trace",
]
