"""selection-proto: KV-cache-aware worker selection for LLM fleets, as a Sans-IO library."""

from ._version import __version__
from .core import *  # noqa: F403
from .core import __all__ as _core_all

__all__ = ["__version__", *_core_all]
