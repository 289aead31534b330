"""Task kinds: one folder each (task.py + one .cuh per GPU architecture), found by the registry."""
