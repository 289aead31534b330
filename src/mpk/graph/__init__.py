"""Graph: named tensors plus ops (a task kind, a 3-D grid, and how the grid splits each operand).

Import from `mpk.graph.graph` (Graph, Op); tensor descriptions live in `mpk.tensors`.
"""
