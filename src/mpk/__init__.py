"""MPK: compile the decode step of a decoder LLM into one persistent CUDA megakernel."""

from mpk.api import CompiledKernel, PersistentKernel
from mpk.errors import MpkError

__all__ = ["CompiledKernel", "MpkError", "PersistentKernel"]
__version__ = "0.1.0"
