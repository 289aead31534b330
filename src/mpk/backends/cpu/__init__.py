"""The CPU interpreter: executes a Plan task by task with the task kinds' torch references."""
