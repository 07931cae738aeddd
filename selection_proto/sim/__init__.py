"""`selection-proto simulate`: a fleet of simulated engines replaying a Mooncake trace through
the real core, in virtual time (docs/ROUTING.md). Pure: the caller reads the trace's lines and
writes the outputs; nothing here reads a clock or does I/O."""

from .engine import EngineModel, FleetConfig
from .fleet import PdSetup, SettingRun, simulate
from .trace import TraceError, TraceRequest, parse_trace

__all__ = ["EngineModel", "FleetConfig", "PdSetup", "SettingRun", "TraceError", "TraceRequest", "parse_trace", "simulate"]
