"""Profiling the megakernel: per-record timer stamps -> timeline, Perfetto trace, picture, table.

The profiling build (CudaExecutor(profile=True)) has thread 0 of every CTA stamp each record it
runs with %globaltimer three times: WAIT (it starts the record), RUN (its waits are met, the task
starts) and END (it ran and signalled). Everything here is plain numpy on those stamps plus the Plan, so all of
it runs, and is tested, without a GPU; only `profile_model` needs one.
"""

from mpk.profile.table import KindTable, kind_table, render_table
from mpk.profile.timeline import TaskEvent, Timeline, from_stamps
from mpk.profile.trace import chrome_trace, write_trace

__all__ = ["KindTable", "TaskEvent", "Timeline", "chrome_trace", "from_stamps", "kind_table",
           "render_table", "write_trace"]
