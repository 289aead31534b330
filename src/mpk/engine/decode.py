"""The host decode loop: feed prompts through launches of a compiled decode step, collect tokens.

Step semantics (see mpk.backends.base): every batch row starts at position 0 and all rows advance
together, one position per decode step. Row b with a prompt of L_b tokens is forced to its prompt
token at global steps 0 .. L_b-1 (graph IO "prompt"; -1 means "embed the model's own previous
sample"), and its generated token #j comes out of global step L_b-1+j (graph IO "tokens_out").
A launch runs up to steps_per_launch steps; "positions" holds the global step of its local step 0.
"""

from __future__ import annotations

import logging
import operator
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import torch

from mpk.backends.base import Executor
from mpk.errors import MpkError

log = logging.getLogger(__name__)

# Graph IO names the engine reads and writes (fixed by the model builder).
PROMPT = "prompt"
POSITIONS = "positions"
PAGE_TABLE = "page_table"
TOKENS_OUT = "tokens_out"
NO_FORCE = -1


class InvalidRequestError(MpkError):
    """A generation request the engine cannot run: empty prompt, bad token id, too long."""


@dataclass(frozen=True)
class GenerationResult:
    """Generated ids per prompt (prompt excluded, EOS kept) and where the time went.

    timings (seconds unless the key says otherwise): compile_s (plan compilation in this call,
    0 when the plan was cached), load_s (weight preparation and executor set-up paid by this
    call), prefill_s (launch time until every row had its first token), decode_s (the rest),
    ms_per_token (decode time per decode step; every step yields one token per row), steps,
    launches.
    """

    token_ids: list[list[int]]
    timings: dict[str, float] = field(default_factory=dict)


def validate_request(prompts: Sequence[Sequence[int]], max_new_tokens: int, vocab_size: int,
                     max_seq_len: int) -> list[list[int]]:
    """The prompts as lists of ints, or InvalidRequestError naming the offending prompt."""
    if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence):
        raise InvalidRequestError("prompts must be a list of token-id lists")
    if not prompts:
        raise InvalidRequestError("no prompts given: pass at least one list of token ids")
    if not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        raise InvalidRequestError(f"max_new_tokens must be an integer >= 0, got {max_new_tokens!r}")
    out: list[list[int]] = []
    for b, prompt in enumerate(prompts):
        if isinstance(prompt, (str, bytes)) or not isinstance(prompt, Iterable):
            raise InvalidRequestError(f"prompt {b} is {type(prompt).__name__}, expected a list of "
                                      f"token ids")
        ids = [_token_id(tok, b, i, vocab_size) for i, tok in enumerate(prompt)]
        if not ids:
            raise InvalidRequestError(f"prompt {b} is empty: every prompt needs at least one token")
        need = len(ids) + max(max_new_tokens, 1) - 1
        if need > max_seq_len:
            raise InvalidRequestError(
                f"prompt {b} has {len(ids)} tokens; with max_new_tokens={max_new_tokens} it needs "
                f"{need} positions, more than max_seq_len={max_seq_len}")
        out.append(ids)
    return out


def _token_id(tok: object, b: int, i: int, vocab_size: int) -> int:
    """An int token id (numpy / torch integers accepted) inside the vocabulary."""
    try:
        value = operator.index(tok)  # type: ignore[arg-type]
    except TypeError:
        value = None
    if isinstance(tok, bool) or value is None or not 0 <= value < vocab_size:
        raise InvalidRequestError(f"prompt {b}, position {i}: token id {tok!r} is outside the "
                                  f"vocabulary [0, {vocab_size})")
    return value


def steps_needed(prompts: Sequence[Sequence[int]], max_new_tokens: int) -> int:
    """Decode steps until every row has max_new_tokens tokens (without EOS)."""
    return max(len(p) + max_new_tokens - 1 for p in prompts)


@dataclass
class DecodeStats:
    steps: int = 0
    launches: int = 0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    decode_steps: int = 0


def decode(executor: Executor, prompts: Sequence[Sequence[int]], max_new_tokens: int,
           eos_token_ids: Iterable[int], steps_per_launch: int,
           on_steps: Callable[[int], None] | None = None) -> tuple[list[list[int]], DecodeStats]:
    """Run launches until every row has max_new_tokens tokens or has produced an EOS.

    The executor's page table must already cover steps_needed(prompts, max_new_tokens) positions
    of every row; the plan's batch size is len(prompts). `on_steps(n)` is called after each
    launch of n steps.
    """
    rows = len(prompts)
    eos = {int(t) for t in eos_token_ids}
    lengths = [len(p) for p in prompts]
    first_token_step = max(lengths) - 1  # the step at which the last row gets its first token
    outputs: list[list[int]] = [[] for _ in range(rows)]
    done = [max_new_tokens == 0] * rows
    stats = DecodeStats()
    g = 0
    while not all(done):
        # Run no further than the last step an unfinished row still needs.
        horizon = max(lengths[b] + max_new_tokens - 1 for b in range(rows) if not done[b])
        n = min(steps_per_launch, horizon - g)
        executor.write(PROMPT, _prompt_rows(prompts, g, steps_per_launch))
        executor.write(POSITIONS, torch.full((rows,), g, dtype=torch.int32))
        start = time.perf_counter()
        executor.run(n)
        produced = executor.read(TOKENS_OUT)
        elapsed = time.perf_counter() - start
        prefill_steps = min(n, max(0, first_token_step + 1 - g))
        stats.prefill_s += elapsed * prefill_steps / n
        stats.decode_s += elapsed * (n - prefill_steps) / n
        stats.decode_steps += n - prefill_steps
        stats.launches += 1
        for s in range(n):
            step = g + s
            for b in range(rows):
                if done[b] or step < lengths[b] - 1:
                    continue
                token = int(produced[s, b])
                outputs[b].append(token)
                done[b] = token in eos or len(outputs[b]) >= max_new_tokens
        g += n
        stats.steps = g
        if on_steps is not None:
            on_steps(n)
        log.debug("launch %d: steps %d..%d in %.2f ms", stats.launches, g - n, g - 1,
                  elapsed * 1e3)
    return outputs, stats


def _prompt_rows(prompts: Sequence[Sequence[int]], start: int, steps: int) -> torch.Tensor:
    """[steps, B] int32: row s holds each row's forced token at global step start+s, else -1."""
    table = torch.full((steps, len(prompts)), NO_FORCE, dtype=torch.int32)
    for b, prompt in enumerate(prompts):
        chunk = list(prompt[start: start + steps])
        if chunk:
            table[: len(chunk), b] = torch.tensor(chunk, dtype=torch.int32)
    return table
