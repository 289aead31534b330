"""The host decode loop against a fake executor whose 'model' is a simple arithmetic rule.

The fake follows the backend step semantics exactly (prompt rows, positions, tokens_out, local
steps), so these tests pin down the engine's bookkeeping without compiling a model.
"""

from __future__ import annotations

import pytest
import torch

from mpk.engine.decode import InvalidRequestError, decode, steps_needed, validate_request

VOCAB = 97


def rule(token: int, position: int) -> int:
    return (token * 7 + position + 1) % VOCAB


class FakeExecutor:
    """Next token = rule(embedded token, position); checks the page table covers each position."""

    def __init__(self, batch: int, steps_per_launch: int, page_size: int = 4) -> None:
        self.io = {"prompt": torch.zeros(steps_per_launch, batch, dtype=torch.int32),
                   "positions": torch.zeros(batch, dtype=torch.int32),
                   "page_table": torch.arange(batch * 64, dtype=torch.int32).reshape(batch, 64),
                   "tokens_out": torch.full((steps_per_launch, batch), -7, dtype=torch.int32)}
        self.tokens = torch.full((batch,), -5, dtype=torch.int32)  # never embedded at step 0
        self.page_size = page_size
        self.launches: list[int] = []

    def bind(self, name: str, tensor: torch.Tensor) -> None:
        self.io[name] = tensor

    def write(self, name: str, value: torch.Tensor) -> None:
        assert value.shape == self.io[name].shape, name
        self.io[name].copy_(value)

    def read(self, name: str) -> torch.Tensor:
        return self.io[name].clone()

    def run(self, num_steps: int = 1) -> None:
        assert 1 <= num_steps <= self.io["prompt"].shape[0]
        self.launches.append(num_steps)
        for s in range(num_steps):
            for b in range(self.tokens.shape[0]):
                forced = int(self.io["prompt"][s, b])
                token = forced if forced >= 0 else int(self.tokens[b])
                assert 0 <= token < VOCAB, f"row {b} embeds {token} at local step {s}"
                pos = int(self.io["positions"][b]) + s
                assert int(self.io["page_table"][b, pos // self.page_size]) >= 0
                self.tokens[b] = rule(token, pos)
            self.io["tokens_out"][s] = self.tokens


def expected(prompt: list[int], max_new: int) -> list[int]:
    token, out = prompt[0], []
    for pos in range(len(prompt) + max_new - 1):
        token = prompt[pos] if pos < len(prompt) else token
        token = rule(token, pos)
        if pos >= len(prompt) - 1:
            out.append(token)
    return out


PROMPTS = [[5, 9, 2], [11], [3, 1, 4, 1, 5, 9, 2]]


@pytest.mark.parametrize("steps_per_launch", [1, 3, 4, 16])
def test_rows_of_different_lengths_match_the_rule(steps_per_launch: int) -> None:
    ex = FakeExecutor(len(PROMPTS), steps_per_launch)
    out, stats = decode(ex, PROMPTS, 12, (), steps_per_launch)
    assert out == [expected(p, 12) for p in PROMPTS]
    assert stats.steps == steps_needed(PROMPTS, 12) == 7 + 12 - 1
    assert sum(ex.launches) == stats.steps
    assert all(n == steps_per_launch for n in ex.launches[:-1])
    assert stats.launches == len(ex.launches)


def test_eos_truncates_after_the_eos_token_and_stops_early() -> None:
    free = expected([11], 30)
    eos = free[4]
    cut = free[: free.index(eos) + 1]
    ex = FakeExecutor(1, 4)
    out, stats = decode(ex, [[11]], 30, [eos], 4)
    assert out == [cut]
    assert stats.steps < 30  # stopped well before max_new_tokens
    assert stats.steps == 4 * -(-len(cut) // 4)


def test_a_finished_row_stops_collecting_while_others_continue() -> None:
    long_free = expected([3, 1, 4], 10)
    short_free = expected([11], 10)
    eos = short_free[1]
    assert eos not in long_free  # the rule's sequences: so only row 0 stops early
    ex = FakeExecutor(2, 4)
    out, stats = decode(ex, [[11], [3, 1, 4]], 10, [eos], 4)
    assert out == [short_free[:2], long_free]
    assert stats.steps == 3 + 10 - 1


def test_zero_new_tokens_runs_nothing() -> None:
    ex = FakeExecutor(1, 4)
    out, stats = decode(ex, [[1, 2]], 0, (), 4)
    assert out == [[]] and ex.launches == [] and stats.steps == 0


@pytest.mark.parametrize(("prompts", "max_new", "message"), [
    ([], 4, "no prompts"),
    ([[1], []], 4, "prompt 1 is empty"),
    ([[1, 256]], 4, r"token id 256 is outside the vocabulary \[0, 256\)"),
    ([[-1]], 4, "token id -1"),
    ([[1.5]], 4, "token id 1.5"),
    ([[1] * 60], 6, "needs 65 positions, more than max_seq_len=64"),
    ([[1]], -1, "max_new_tokens must be an integer >= 0"),
    ("hello", 4, "list of token-id lists"),
    ([["a"]], 4, "token id 'a'"),
])
def test_bad_requests(prompts: object, max_new: int, message: str) -> None:
    with pytest.raises(InvalidRequestError, match=message):
        validate_request(prompts, max_new, vocab_size=256, max_seq_len=64)  # type: ignore[arg-type]


def test_a_request_that_fills_max_seq_len_exactly_is_fine() -> None:
    assert validate_request([[1] * 60], 5, vocab_size=256, max_seq_len=64) == [[1] * 60]


def test_numpy_and_torch_integers_are_token_ids() -> None:
    import numpy as np

    prompts = [np.array([3, 4]), torch.tensor([5]), (6, 7)]
    out = validate_request(prompts, 2, vocab_size=256, max_seq_len=64)  # type: ignore[arg-type]
    assert out == [[3, 4], [5], [6, 7]]
    assert all(type(t) is int for row in out for t in row)
