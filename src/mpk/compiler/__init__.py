"""Compiler: Graph -> tasks -> dependency counters -> per-SM schedule -> Plan."""
