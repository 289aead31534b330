"""A launch's rows: which rows each running request holds, what the host writes for them (the
decode IO contract, models/decode_io.py) and how a launch moves the requests' positions.

A request (Running) holds `width` consecutive rows of a launch (Rows) from position `pos`: one
row decodes or feeds its prompt a position a step; a run of w > 1 rows feeds w consecutive
prompt positions a step (tasks/runs.py). The scheduler (engine/scheduler.py) decides which
requests go into a launch and on which plan; this module lays them out and writes the inputs.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from mpk.backends.base import Executor
from mpk.engine.requests import FinishReason, RequestHandle, SamplingParams
from mpk.models import decode_io as io
from mpk.tasks import sampling
from mpk.tasks.runs import encode as run_words


@dataclass
class Running:
    handle: RequestHandle
    pages: list[int]
    pos: int = 0  # the next position to lay out (a launch moves it when it starts)
    stop_ids: frozenset[int] = frozenset()
    finished: FinishReason | None = None
    sampling_words: tuple[int, ...] = (0,) * io.SAMPLING_WORDS

    @property
    def steps_left(self) -> int:
        """Steps to its end when it runs alone."""
        return len(self.handle.prompt) - 1 + self.handle.params.max_tokens - self.pos

    @property
    def prompt_left(self) -> int:
        """Prompt positions still to feed (the last one yields the first token)."""
        return len(self.handle.prompt) - self.pos


@dataclass(frozen=True)
class Rows:
    """The rows one request holds in a launch: `width` consecutive rows from `first`, feeding
    positions from `pos` (the request's at the launch's start)."""

    run: Running
    first: int
    width: int
    pos: int

    @property
    def is_run(self) -> bool:
        return self.width > 1


@dataclass(frozen=True)
class InputShape:
    """What a plan's decode inputs hold: `rows` rows, `steps` steps a launch, `max_pages` KV
    pages a row; `sampling` / `runs`: whether the plan has the SAMPLING / RUNS input (every
    model plan does; test doubles of an executor may not)."""

    rows: int
    steps: int
    max_pages: int
    sampling: bool = True
    runs: bool = True


def lay_out(running: list[Running], n: int, rows: int, runs: bool) -> list[Rows]:
    """One row for each of `running` (in order) on a plan of `rows` rows; with `runs` (the plan
    has the RUNS input), the spare rows, oldest request first, widen the requests whose prompt
    would not be fed within n steps into runs that feed it in n; rows still spare widen those
    runs further (so the launch can end sooner)."""
    widths = [1] * len(running)
    spare = rows - len(running) if runs else 0
    needy = [k for k, run in enumerate(running) if run.prompt_left > n]
    for k in needy:  # enough rows to feed the prompt within n steps
        grow = min(spare, -(-running[k].prompt_left // n) - 1)
        widths[k] += grow
        spare -= grow
    for k in needy:  # then what is left, up to one row per prompt position
        grow = min(spare, running[k].prompt_left - widths[k])
        widths[k] += grow
        spare -= grow
    layout, first = [], 0
    for run, width in zip(running, widths):
        layout.append(Rows(run, first, width, run.pos))
        first += width
    return layout


def write_inputs(executor: Executor, layout: list[Rows], shape: InputShape,
                 follows: set[int]) -> None:
    """The launch's inputs on a plan of `shape`. `follows`: the rows that go on from the launch
    before in the same row, past their prompt: they embed their own last sample (followers)."""
    # Rows as Python lists, one tensor per input: per-element tensor writes cost more host
    # time than the launch of a small model's step.
    follow = [io.NO_FORCE] * shape.steps
    columns = [[0] * shape.steps for _ in range(shape.rows)]  # unused rows embed 0
    positions = [0] * shape.rows
    table = [[io.NO_PAGE] * shape.max_pages for _ in range(shape.rows)]
    words = [[0] * io.SAMPLING_WORDS for _ in range(shape.rows)]
    runs = [[0] * io.RUN_WORDS for _ in range(shape.rows)]
    for rows in layout:
        run = rows.run
        for i in range(rows.width):
            b = rows.first + i
            positions[b] = run.pos + i
            table[b][: len(run.pages)] = run.pages
            words[b] = list(run.sampling_words)
            runs[b] = list(run_words(i, rows.width))
            columns[b] = follow if b in follows else forced(rows, i, shape.steps)
    executor.write(io.PROMPT, torch.tensor(columns, dtype=torch.int32).T.contiguous())
    executor.write(io.POSITIONS, torch.tensor(positions, dtype=torch.int32))
    executor.write(io.PAGE_TABLE, torch.tensor(table, dtype=torch.int32))
    if shape.sampling:
        executor.write(io.SAMPLING, torch.tensor(words, dtype=torch.int32))
    if shape.runs:
        executor.write(io.RUNS, torch.tensor(runs, dtype=torch.int32))


def forced(rows: Rows, i: int, steps: int) -> list[int]:
    """Row i's PROMPT column: its prompt tokens; past the prompt a run row embeds token 0
    (its steps are idle) and a row alone its own previous token (forced at step 0, since
    the request may have held another row in the last launch)."""
    run, ids = rows.run, rows.run.handle.prompt
    if not rows.is_run and run.pos + i >= len(ids):  # decoding (the common row, in short)
        return [run.handle.last_token] + [io.NO_FORCE] * (steps - 1)
    out = []
    for s in range(steps):
        p = run.pos + s * rows.width + i
        if p < len(ids):
            out.append(ids[p])
        elif rows.is_run:
            out.append(0)
        elif s == 0:
            out.append(run.handle.last_token)
        else:
            out.append(io.NO_FORCE)
    return out


def advance(rows: Rows, n: int) -> None:
    """Move rows.run past the positions a launch of n steps feeds it (a run: up to its prompt's
    end; its later rows' steps are idle)."""
    run = rows.run
    if rows.is_run:
        run.pos = min(rows.pos + n * rows.width, len(run.handle.prompt))
    else:
        run.pos = rows.pos + n


def followers(before: list[Rows], layout: list[Rows]) -> set[int]:
    """The rows of `layout` held by a request that held that row alone in `before` (the layout
    of the launch just before, on the same plan) and is past its prompt: its row's last sample
    is its last token, so it need not be forced."""
    held = {id(r.run): r.first for r in before if not r.is_run}
    return {r.first for r in layout if not r.is_run and held.get(id(r.run)) == r.first
            and r.pos >= len(r.run.handle.prompt)}


def sampling_words(params: SamplingParams) -> tuple[int, ...]:
    """A request's row of the SAMPLING input (tasks/sampling.py owns the layout)."""
    if params.greedy:
        return sampling.encode(0.0, 0)
    seed = params.seed if params.seed is not None else random.SystemRandom().getrandbits(63)
    return sampling.encode(params.temperature, seed, params.top_k, params.top_p)
