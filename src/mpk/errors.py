"""The exceptions MPK raises. Every user-facing failure is one of these, with names in the message."""

from __future__ import annotations


class MpkError(Exception):
    """Base class of all MPK errors."""


class GraphError(MpkError):
    """A graph is malformed: bad name, wrong shape, a grid that does not divide a tensor."""


class UnsupportedError(MpkError):
    """A configuration MPK does not support (model feature, dtype, GPU architecture)."""


class CompileError(MpkError):
    """The compiler or nvcc failed. For nvcc failures the message holds the log and the source path."""


class DeadlockError(CompileError):
    """The per-SM task lists could block each other forever."""


class KernelHangError(MpkError):
    """The watchdog stopped the megakernel: a wait did not complete in time."""


class CheckpointError(MpkError):
    """A checkpoint directory is missing files or holds tensors of the wrong shape."""
