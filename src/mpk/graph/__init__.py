"""Graph: named tensors plus ops (a task kind, a 3-D grid, and how the grid splits each operand).

Import from the submodules: `mpk.graph.tensor` (TensorSpec, Role) and `mpk.graph.graph` (Graph, Op).
"""
