"""Backends execute a Plan: `cpu` (the torch interpreter, the reference semantics) and `cuda`."""
