"""The continuous-batching scheduler against a fake executor whose 'model' is an arithmetic rule.

The fake follows the backend step semantics exactly (prompt rows, per-row positions, runs, page
table, tokens_out, local steps) and has a KV cache: a row's next token depends on its token, its
position and every token at the positions before it, read through its page table, with this
step's earlier run rows taken from the step itself and the cache written only after every row
has read (so a schedule that relied on another row's write of the same step would read poison).
These tests pin down the scheduler's bookkeeping without compiling a model: staggered arrivals
give each request its solo tokens, prompts fed as runs give the same tokens, slots and pages are
reused, stops, cancellation and KV exhaustion lose nothing. The fakes run in a CUDA stream's
order (mpk.testing.StreamOrdered): a launch started before the last one's tokens are read runs
after it, as do the inputs written meanwhile.
"""

from __future__ import annotations

import pytest
import torch

from mpk.engine.kv_cache import PagePool
from mpk.engine.requests import (FinishReason, InvalidRequestError, RequestHandle,
                                 SamplingParams, validate_prompt)
from mpk.engine.scheduler import Scheduler
from mpk.models import decode_io as io
from mpk.tasks.runs import row_run
from mpk.testing import Stream, StreamOrdered

VOCAB = 97
PAGE = 4
MAX_PAGES = 16
POISON = 1000  # what an unwritten or unmapped position contributes


def rule(token: int, position: int, history: int) -> int:
    return (token * 7 + position + 1 + history) % VOCAB


def weigh(tokens: list[int]) -> int:
    """What the positions before p contribute: order-sensitive."""
    return sum(t * (q + 3) for q, t in enumerate(tokens))


class FakeExecutor:
    """Next token = rule(embedded token, position, weigh(tokens at earlier positions)). Records
    every launch's page table and run layout and checks that a row never embeds an invalid
    token."""

    def __init__(self, batch: int, steps_per_launch: int, num_pages: int) -> None:
        self.io = {io.PROMPT: torch.zeros(steps_per_launch, batch, dtype=torch.int32),
                   io.POSITIONS: torch.zeros(batch, dtype=torch.int32),
                   io.PAGE_TABLE: torch.zeros(batch, MAX_PAGES, dtype=torch.int32),
                   io.TOKENS_OUT: torch.full((steps_per_launch, batch), -7, dtype=torch.int32),
                   io.SAMPLING: torch.zeros(batch, io.SAMPLING_WORDS, dtype=torch.int32),
                   io.RUNS: torch.zeros(batch, io.RUN_WORDS, dtype=torch.int32)}
        self.tokens = torch.full((batch,), -5, dtype=torch.int32)
        self.cache = [-1] * (num_pages * PAGE)  # the embedded token at each (page, slot)
        self.launches: list[int] = []
        self.tables: list[torch.Tensor] = []
        self.widths: list[int] = []  # the widest run of each launch
        self.firsts: list[list[int]] = []  # each launch's PROMPT row of local step 0

    def write(self, name: str, value: torch.Tensor) -> None:
        assert value.shape == self.io[name].shape, name
        self.io[name].copy_(value)

    def read(self, name: str) -> torch.Tensor:
        return self.io[name].clone()

    def _slot(self, b: int, q: int) -> int | None:
        page = int(self.io[io.PAGE_TABLE][b, q // PAGE]) if q // PAGE < MAX_PAGES else -1
        return page * PAGE + q % PAGE if 0 <= page < len(self.cache) // PAGE else None

    def run(self, num_steps: int = 1) -> None:
        assert 1 <= num_steps <= self.io[io.PROMPT].shape[0]
        batch = self.tokens.shape[0]
        words = self.io.get(io.RUNS)  # a plan without the input: every row alone
        runs = [row_run(None if words is None else words[b], b) for b in range(batch)]
        self.launches.append(num_steps)
        self.tables.append(self.io[io.PAGE_TABLE].clone())
        self.widths.append(max(w for _, w in runs))
        self.firsts.append(self.io[io.PROMPT][0].tolist())
        for s in range(num_steps):
            embedded, positions = [], []
            for b in range(batch):
                forced = int(self.io[io.PROMPT][s, b])
                token = forced if forced >= 0 else int(self.tokens[b])
                assert 0 <= token < VOCAB, f"row {b} embeds {token} at local step {s}"
                embedded.append(token)
                positions.append(int(self.io[io.POSITIONS][b]) + s * runs[b][1])
            for b in range(batch):
                index, p = runs[b][0], positions[b]
                before = []
                for q in range(p):
                    if q >= p - index:  # an earlier row of this step's run
                        before.append(embedded[b - (p - q)])
                    else:
                        slot = self._slot(b, q)
                        token = self.cache[slot] if slot is not None else -1
                        before.append(token if token >= 0 else POISON)
                self.tokens[b] = rule(embedded[b], p, weigh(before))
            for b in range(batch):  # the cache writes land after every row has read
                slot = self._slot(b, positions[b])
                if slot is not None:
                    self.cache[slot] = embedded[b]
            self.io[io.TOKENS_OUT][s] = self.tokens


def solo(prompt: list[int], max_new: int, stop: tuple[int, ...] = ()) -> list[int]:
    token, out, seen = prompt[0], [], []
    for pos in range(len(prompt) + max_new - 1):
        token = prompt[pos] if pos < len(prompt) else token
        nxt = rule(token, pos, weigh(seen))
        seen.append(token)
        token = nxt
        if pos >= len(prompt) - 1:
            out.append(token)
            if token in stop:
                break
    return out


def make(slots: int, steps: int, pages: int = 64, **opts) -> tuple[Scheduler, FakeExecutor]:
    ex = StreamOrdered(FakeExecutor(slots, steps, pages))
    return Scheduler(ex, PagePool(pages, PAGE), slots, MAX_PAGES, steps, **opts), ex


def drain(sched: Scheduler) -> None:
    while sched.has_work():
        sched.step()


PROMPTS = [[5, 9, 2], [11], [3, 1, 4, 1, 5, 9, 2]]


@pytest.mark.parametrize("steps_per_launch", [1, 3, 4, 16])
def test_rows_of_different_lengths_match_the_rule(steps_per_launch: int) -> None:
    sched, ex = make(3, steps_per_launch)
    handles = [sched.submit(RequestHandle(p, SamplingParams(max_tokens=12))) for p in PROMPTS]
    drain(sched)
    assert [h.result().token_ids for h in handles] == [solo(p, 12) for p in PROMPTS]
    assert sum(ex.launches) == sched.stats.steps == 7 + 12 - 1
    assert all(h.result().finish_reason is FinishReason.LENGTH for h in handles)
    assert sched.pool.num_free == 64  # every page came back


def test_staggered_arrivals_get_their_solo_tokens() -> None:
    """More requests than slots, arriving between launches: each gets exactly its solo run."""
    sched, ex = make(2, 3)
    prompts = [[5, 9, 2], [11], [3, 1, 4, 1, 5], [42, 7], [8] * 9]
    handles = []
    for i, p in enumerate(prompts):
        handles.append(sched.submit(RequestHandle(p, SamplingParams(max_tokens=5 + i))))
        sched.step()  # one launch between arrivals
    drain(sched)
    for i, (p, h) in enumerate(zip(prompts, handles)):
        assert h.result().token_ids == solo(p, 5 + i), i
    assert sched.pool.num_free == 64


def test_a_stop_id_frees_the_slot_for_a_waiting_request() -> None:
    free = solo([11], 30)
    eos = free[4]
    sched, ex = make(1, 4, eos_token_ids=[eos])
    first = sched.submit(RequestHandle([11], SamplingParams(max_tokens=30)))
    second = sched.submit(RequestHandle([3, 1], SamplingParams(max_tokens=6)))
    drain(sched)
    assert first.result().token_ids == free[:5]
    assert first.result().finish_reason is FinishReason.STOP
    assert second.result().token_ids == solo([3, 1], 6, (eos,))
    assert sum(ex.launches) < 30  # the first request stopped early


def test_a_launch_wakes_the_reader_once_and_a_stop_mid_launch_drops_the_rest() -> None:
    free = solo([11], 30)
    sched, ex = make(1, 8, eos_token_ids=[free[10]])
    handle = sched.submit(RequestHandle([11], SamplingParams(max_tokens=30)))
    drain(sched)
    chunks = []
    while not handle._queue.empty():
        chunks.append(handle._queue.get_nowait())
    # Launches of 8 steps: tokens 0-7, then 8-10 (the stop id), the rest of that launch dropped.
    assert [len(c) for c in chunks[:-1]] == [8, 3] and not isinstance(chunks[-1], tuple)
    assert list(chunks[0] + chunks[1]) == free[:11] == handle.result().token_ids
    assert handle.result().finish_reason is FinishReason.STOP


def test_a_full_batch_starts_each_launch_before_the_last_ones_tokens_are_read() -> None:
    """Every slot decoding: after a step hands out a launch's tokens the next launch is already
    in the stream, its rows embedding their own last samples (NO_FORCE at local step 0), and
    every request keeps its solo tokens, all the steps counted once."""
    sched, ex = make(2, 4)
    prompts = ([5, 9], [2, 3, 7])
    handles = [sched.submit(RequestHandle(p, SamplingParams(max_tokens=17))) for p in prompts]
    sched.step()
    assert ex.launches == [4] and sched.has_work() and sched.stats.overlapped == 1
    drain(sched)
    assert [h.result().token_ids for h in handles] == [solo(p, 17) for p in prompts]
    assert ex.firsts[0] == [5, 2] and ex.firsts[1] == [io.NO_FORCE] * 2
    assert sched.stats.overlapped == len(ex.launches) - 1  # all but the first
    assert sum(ex.launches) == sched.stats.steps == 3 + 17 - 1 and sched.pool.num_free == 64


def test_an_executor_that_cannot_overlap_runs_no_launch_early() -> None:
    """Without `start` (the interpreter) an early launch would run before the last one's tokens
    are handed out: only an executor that overlaps gets one."""
    ex = FakeExecutor(2, 4, 64)
    sched = Scheduler(ex, PagePool(64, PAGE), 2, MAX_PAGES, 4)
    handles = [sched.submit(RequestHandle(p, SamplingParams(max_tokens=9))) for p in ([5], [7])]
    sched.step()
    assert ex.launches == [4]
    drain(sched)
    assert sched.stats.overlapped == 0
    assert [h.result().token_ids for h in handles] == [solo([5], 9), solo([7], 9)]


def test_a_closed_batch_keeps_starting_launches_early_after_a_request_ends() -> None:
    """After close() (Engine.generate's batch), a request that ends frees a slot that nobody
    can take: the launches after it start early again (only the one laid out anew after the
    end, where the rows move, cannot). New submissions are refused."""
    counts = []
    for closed in (False, True):
        sched, ex = make(3, 4)
        prompts, lengths = ([5], [7], [9]), (5, 20, 20)
        handles = [sched.submit(RequestHandle(p, SamplingParams(max_tokens=m)))
                   for p, m in zip(prompts, lengths)]
        if closed:
            sched.close()
            with pytest.raises(InvalidRequestError, match="closed"):
                sched.submit(RequestHandle([1], SamplingParams(max_tokens=2)))
        drain(sched)
        assert [h.result().token_ids for h in handles] == [
            solo(p, m) for p, m in zip(prompts, lengths)]
        counts.append((sched.stats.overlapped, len(ex.launches)))
    assert counts == [(1, 5), (3, 5)]  # launches 2 / 2, 4, 5 of 5 started early


def test_a_stop_found_after_the_next_launch_started_drops_that_launchs_tokens() -> None:
    """A stop id in a launch whose successor is already running: the request ends there, its
    row's tokens in the successor are dropped, its slot and pages go to the waiting request
    (which then runs beside the other one), and everybody keeps the solo tokens."""
    free = solo([11], 30)
    eos = free[5]
    sched, ex = make(2, 4, eos_token_ids=[eos])
    a = sched.submit(RequestHandle([11], SamplingParams(max_tokens=30)))
    b = sched.submit(RequestHandle([6, 2], SamplingParams(max_tokens=20)))
    c = sched.submit(RequestHandle([3, 1, 4], SamplingParams(max_tokens=9)))  # waits for a slot
    drain(sched)
    assert a.result().token_ids == free[:6] and a.result().finish_reason is FinishReason.STOP
    assert b.result().token_ids == solo([6, 2], 20, (eos,))
    assert c.result().token_ids == solo([3, 1, 4], 9, (eos,))
    assert sched.pool.num_free == 64
    # Launch 2 yields a's tokens 4-7 (the stop is 5); launch 3 had started on a's pages.
    assert ex.firsts[2] == [io.NO_FORCE] * 2 and torch.equal(ex.tables[2][0], ex.tables[1][0])
    assert ex.firsts[3][0] != io.NO_FORCE  # then b moved to row 0: forced to its last token


def test_cancelling_while_a_launch_is_in_flight_loses_nothing_else() -> None:
    sched, ex = make(2, 4)
    a = sched.submit(RequestHandle([1, 2], SamplingParams(max_tokens=30)))
    b = sched.submit(RequestHandle([4], SamplingParams(max_tokens=14)))
    sched.step()
    sched.step()
    a.cancel()
    c = sched.submit(RequestHandle([8, 8, 1], SamplingParams(max_tokens=6)))
    drain(sched)
    assert a.result().finish_reason is FinishReason.CANCELLED
    # Two launches handed out before the cancel (3 + 4 tokens); none from the one in flight.
    assert a.result().token_ids == solo([1, 2], 30)[:7]
    assert b.result().token_ids == solo([4], 14) and c.result().token_ids == solo([8, 8, 1], 6)
    assert sched.pool.num_free == 64


class FailingExecutor(FakeExecutor):
    """A fake whose `fail_at`-th launch fails (a kernel fault or the watchdog)."""

    def __init__(self, fail_at: int, *args: int) -> None:
        super().__init__(*args)
        self.fail_at = fail_at

    def run(self, num_steps: int = 1) -> None:
        if len(self.launches) + 1 == self.fail_at:
            raise RuntimeError("the megakernel failed")
        super().run(num_steps)


def test_a_launch_failing_while_the_next_is_in_flight_ends_every_request() -> None:
    """As the serving loop does on a failed launch: fail_all ends every request, running and
    waiting, with the error; the launch in flight is dropped and every page comes back."""
    ex = StreamOrdered(FailingExecutor(3, 2, 4, 64))
    sched = Scheduler(ex, PagePool(64, PAGE), 2, MAX_PAGES, 4)
    handles = [sched.submit(RequestHandle(p, SamplingParams(max_tokens=30)))
               for p in ([5], [7], [9])]
    sched.step()
    sched.step()
    with pytest.raises(RuntimeError, match="failed"):
        sched.step()
    sched.fail_all("the megakernel failed")
    assert not sched.has_work() and sched.pool.num_free == 64
    assert all(h.result().finish_reason is FinishReason.ERROR for h in handles)
    assert handles[0].result().token_ids == solo([5], 30)[:8]


def test_with_a_slot_free_no_launch_starts_early() -> None:
    """A request arriving while a slot is free joins the next launch: the scheduler starts no
    launch ahead while a slot is free (the early launch could not take the newcomer)."""
    sched, ex = make(3, 4)
    a = sched.submit(RequestHandle([5, 9], SamplingParams(max_tokens=20)))
    sched.step()
    assert sched.stats.overlapped == 0 and ex.launches == [4]
    b = sched.submit(RequestHandle([7], SamplingParams(max_tokens=5)))
    sched.step()
    assert ex.widths[-1] == 1 and ex.firsts[-1][1] == 7  # b is in the second launch
    drain(sched)
    assert a.result().token_ids == solo([5, 9], 20) and b.result().token_ids == solo([7], 5)


def test_the_iterator_yields_each_token_of_a_launch() -> None:
    sched, _ = make(2, 4)
    handles = [sched.submit(RequestHandle(p, SamplingParams(max_tokens=9))) for p in ([5], [2, 3])]
    drain(sched)
    for handle, prompt in zip(handles, ([5], [2, 3]), strict=True):
        assert list(handle) == handle.result().token_ids == solo(prompt, 9)


def test_cancelled_requests_lose_nothing_else() -> None:
    sched, ex = make(2, 2)
    a = sched.submit(RequestHandle([1, 2, 3], SamplingParams(max_tokens=20)))
    b = sched.submit(RequestHandle([4], SamplingParams(max_tokens=8)))
    c = sched.submit(RequestHandle([5, 6], SamplingParams(max_tokens=8)))  # waits for a slot
    d = sched.submit(RequestHandle([7], SamplingParams(max_tokens=8)))
    sched.step()
    a.cancel()
    d.cancel()  # still waiting: never runs
    drain(sched)
    assert a.result().finish_reason is FinishReason.CANCELLED
    assert a.result().token_ids == solo([1, 2, 3], 20)[: len(a.result().token_ids)]
    assert d.result().finish_reason is FinishReason.CANCELLED and d.result().token_ids == []
    assert b.result().token_ids == solo([4], 8) and c.result().token_ids == solo([5, 6], 8)
    assert sched.pool.num_free == 64


def test_requests_wait_for_pages_and_too_large_ones_are_refused() -> None:
    sched, ex = make(3, 4, pages=6)  # 6 pages of 4 positions
    big = SamplingParams(max_tokens=10)  # 3 + 10 - 1 = 12 positions = 3 pages each
    hs = [sched.submit(RequestHandle([1, 2, 3], big)) for _ in range(3)]
    sched.step()
    assert sched.num_running == 2 and len(sched.waiting) == 1  # the third waits for pages
    drain(sched)
    assert all(h.result().token_ids == solo([1, 2, 3], 10) for h in hs)
    with pytest.raises(InvalidRequestError, match="needs 7 KV pages"):
        sched.submit(RequestHandle([1] * 20, SamplingParams(max_tokens=9)))


def test_empty_slots_write_no_kv_pages() -> None:
    sched, ex = make(3, 4)
    h = sched.submit(RequestHandle([1, 2], SamplingParams(max_tokens=3)))
    drain(sched)
    assert h.result().token_ids == solo([1, 2], 3)
    assert all(bool((t[1:] == io.NO_PAGE).all()) for t in ex.tables)


def test_stop_strings_cut_the_text() -> None:
    def detok(ids: list[int]) -> str:
        return "".join(chr(ord("a") + t % 26) for t in ids)

    sched, ex = make(1, 4, detokenize=detok)
    tokens = solo([3], 12)
    text = detok(tokens)
    stop = text[3:5]
    h = sched.submit(RequestHandle([3], SamplingParams(max_tokens=12, stop=(stop,))))
    drain(sched)
    result = h.result()
    assert result.finish_reason is FinishReason.STOP and result.text == text[: text.find(stop)]


def test_zero_max_tokens_and_stats() -> None:
    sched, ex = make(1, 4)
    empty = sched.submit(RequestHandle([1], SamplingParams(max_tokens=0)))
    h = sched.submit(RequestHandle([1, 2], SamplingParams(max_tokens=6)))
    drain(sched)
    assert empty.result().token_ids == [] and ex.launches == [4, 3]
    stats = h.result().stats
    assert stats.ttft_s is not None and stats.ttft_s >= 0 and len(stats.inter_token_s) == 5
    t = stats.token_times
    assert stats.tpot_s == pytest.approx((t[-1] - t[0]) / 5)
    assert list(h) == h.result().token_ids  # the stream holds the same tokens


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"max_tokens": -1}, "max_tokens"), ({"temperature": -0.5}, "temperature"),
    ({"top_p": 0.0}, "top_p"), ({"top_k": 1.5}, "top_k"), ({"seed": "x"}, "seed"),
    ({"stop": ("",)}, "stop"), ({"temperature": float("nan")}, "temperature"),
    ({"top_k": 2**31}, "top_k"),
])
def test_bad_sampling_params(kwargs: dict, message: str) -> None:
    with pytest.raises(InvalidRequestError, match=message):
        SamplingParams(**kwargs)


def test_a_temperature_too_small_to_scale_logits_is_greedy() -> None:
    assert SamplingParams(temperature=1e-6, top_k=5).greedy  # l / 1e-40 would overflow fp32
    assert not SamplingParams(temperature=1e-5).greedy


@pytest.mark.parametrize(("prompt", "message"), [
    ([], "prompt 0 is empty"), ([1, 256], r"token id 256 is outside the vocabulary \[0, 256\)"),
    ([-1], "token id -1"), ([1.5], "token id 1.5"), ("hello", "expected a list"),
    ([True], "token id True"),
])
def test_bad_prompts(prompt: object, message: str) -> None:
    with pytest.raises(InvalidRequestError, match=message):
        validate_prompt(prompt, 256)  # type: ignore[arg-type]


# ---- prompts fed as runs (chunked prefill in the batch) ---------------------------------------
@pytest.mark.parametrize("steps_per_launch", [1, 2, 5, 16])
def test_a_long_prompt_is_fed_as_a_run_with_its_solo_tokens(steps_per_launch: int) -> None:
    prompt = [(i * 13 + 5) % VOCAB for i in range(41)]
    sched, ex = make(6, steps_per_launch)
    h = sched.submit(RequestHandle(prompt, SamplingParams(max_tokens=7)))
    drain(sched)
    assert h.result().token_ids == solo(prompt, 7)
    assert max(ex.widths) == 6  # nothing else runs: every row feeds the prompt
    # the prompt's 41 positions at that width (one step more where the last chunk narrows),
    # then the 6 tokens after the first
    assert sched.stats.steps <= -(-41 // max(ex.widths)) + 1 + 6
    assert sched.pool.num_free == 64


def test_runs_share_the_batch_with_decoding_rows() -> None:
    """A long prompt arrives while two requests decode: it takes the spare rows only, and every
    request still gets its solo tokens."""
    sched, ex = make(5, 4)
    a = sched.submit(RequestHandle([3, 1, 4], SamplingParams(max_tokens=30)))
    b = sched.submit(RequestHandle([9], SamplingParams(max_tokens=25)))
    sched.step()
    long = [(i * 31 + 2) % VOCAB for i in range(37)]
    c = sched.submit(RequestHandle(long, SamplingParams(max_tokens=9)))
    sched.step()
    assert ex.widths[-1] == 3  # the two decoding rows kept theirs
    d = sched.submit(RequestHandle(long[:20], SamplingParams(max_tokens=4)))
    drain(sched)
    assert a.result().token_ids == solo([3, 1, 4], 30)
    assert b.result().token_ids == solo([9], 25)
    assert c.result().token_ids == solo(long, 9)
    assert d.result().token_ids == solo(long[:20], 4)
    assert sched.pool.num_free == 64


@pytest.mark.parametrize("seed", range(6))
def test_random_traces_match_solo_runs(seed: int) -> None:
    """Fixed-seed traces: random prompt lengths, slots, launch lengths and arrival gaps."""
    gen = torch.Generator().manual_seed(seed)

    def randint(lo: int, hi: int) -> int:
        return int(torch.randint(lo, hi, (1,), generator=gen))

    slots, steps = randint(1, 7), randint(1, 6)
    sched, ex = make(slots, steps, pages=200)
    handles = []
    for _ in range(8):
        prompt = torch.randint(0, VOCAB, (randint(1, 30),), generator=gen).tolist()
        handles.append((prompt, n := randint(1, 12),
                        sched.submit(RequestHandle(prompt, SamplingParams(max_tokens=n)))))
        for _ in range(randint(0, 3)):
            sched.step()
    drain(sched)
    for prompt, n, h in handles:
        assert h.result().token_ids == solo(prompt, n)
    assert sched.pool.num_free == 200


def test_without_the_runs_input_every_request_holds_one_row() -> None:
    prompt = list(range(1, 30))
    sched, ex = make(4, 4, runs=False)
    del ex.io[io.RUNS]
    h = sched.submit(RequestHandle(prompt, SamplingParams(max_tokens=5)))
    drain(sched)
    assert h.result().token_ids == solo(prompt, 5)
    assert sched.stats.steps == len(prompt) + 5 - 1


@pytest.mark.parametrize("slots", [2, 3, 5, 8])
@pytest.mark.parametrize("steps", [1, 2, 3, 7])
def test_every_prompt_length_through_runs(slots: int, steps: int) -> None:
    """Prompt lengths 1-33 with 1-3 tokens each, on every run width the slots allow: the first
    token (which a run's last prompt position yields) and the rest equal the solo run."""
    sched, ex = make(slots, steps, pages=400)
    cases = [(n, 1 + n % 3) for n in range(1, 34)]
    handles = [sched.submit(RequestHandle([(7 * i + n) % VOCAB for i in range(n)],
                                          SamplingParams(max_tokens=m))) for n, m in cases]
    drain(sched)
    for (n, m), h in zip(cases, handles):
        assert h.result().token_ids == solo(h.prompt, m), (n, m)
    assert sched.pool.num_free == 400


def test_a_stop_id_at_the_first_token_of_a_run() -> None:
    prompt = [(5 * i + 1) % VOCAB for i in range(30)]
    first = solo(prompt, 1)[0]
    sched, ex = make(6, 4, eos_token_ids=[first])
    h = sched.submit(RequestHandle(prompt, SamplingParams(max_tokens=10)))
    drain(sched)
    assert h.result().token_ids == [first] and h.result().finish_reason is FinishReason.STOP
    assert max(ex.widths) > 1 and sched.pool.num_free == 64


def test_cancelling_a_request_while_its_prompt_runs_frees_its_rows() -> None:
    long = [(3 * i + 2) % VOCAB for i in range(60)]
    sched, ex = make(4, 2)
    a = sched.submit(RequestHandle(long, SamplingParams(max_tokens=5)))
    sched.step()
    assert ex.widths[-1] == 4 and not a.done  # still feeding its prompt
    a.cancel()
    b = sched.submit(RequestHandle([4, 4], SamplingParams(max_tokens=6)))
    drain(sched)
    assert a.result().finish_reason is FinishReason.CANCELLED and a.result().token_ids == []
    assert b.result().token_ids == solo([4, 4], 6) and sched.pool.num_free == 64


def other_plan(slots: FakeExecutor, rows: int):  # type: ignore[no-untyped-def]
    """A plan of `rows` rows on the slots' KV cache (as the engine binds it), the maker the
    scheduler calls on first use, and the list each call appends to."""
    inner = FakeExecutor(rows, slots.io[io.PROMPT].shape[0], len(slots.cache) // PAGE)
    inner.cache = slots.cache
    other = StreamOrdered(inner, slots.stream)
    built: list[int] = []

    def make() -> tuple[FakeExecutor, int]:
        built.append(1)
        return other, rows

    return other, make, built


def test_a_wide_plan_takes_the_launches_that_feed_prompts() -> None:
    """Two slots, a 12-row wide plan on the same cache: launches that feed a long prompt run
    there, decoding-only launches on the slots' plan; every request keeps its solo tokens."""
    pool = PagePool(64, PAGE)
    narrow = StreamOrdered(FakeExecutor(2, 4, 64))
    wide, make_wide, built = other_plan(narrow, 12)
    sched = Scheduler(narrow, pool, 2, MAX_PAGES, 4, wide=make_wide)
    a = sched.submit(RequestHandle([1, 2, 3], SamplingParams(max_tokens=30)))
    sched.step()
    assert not built and narrow.launches == [4]  # nothing to feed: the slots' plan
    long = [(11 * i + 4) % VOCAB for i in range(45)]
    c = sched.submit(RequestHandle(long, SamplingParams(max_tokens=6)))
    drain(sched)
    assert built == [1] and wide.launches and max(wide.widths) > 2
    assert a.result().token_ids == solo([1, 2, 3], 30)
    assert c.result().token_ids == solo(long, 6)
    assert len(narrow.launches) > 1 and pool.num_free == 64


def test_a_lone_request_past_its_prompt_decodes_on_the_one_row_plan() -> None:
    """Four slots and a one-row plan on the same cache: a lone request's prompt is fed as a run
    on the slots' plan, then it decodes on the one-row plan; a second request sends the
    launches back to the slots' plan, and when it finishes the first is alone again. Both keep
    their solo tokens; the one-row plan is built once."""
    pool = PagePool(64, PAGE)
    slots = StreamOrdered(FakeExecutor(4, 4, 64))
    single, make_single, built = other_plan(slots, 1)
    sched = Scheduler(slots, pool, 4, MAX_PAGES, 4, single=make_single)
    prompt = [(5 * i + 2) % VOCAB for i in range(9)]
    a = sched.submit(RequestHandle(prompt, SamplingParams(max_tokens=40)))
    sched.step()
    assert not built and max(slots.widths) > 1  # the prompt: a run on the slots' plan
    while sched.running[0].prompt_left > 1:
        sched.step()
    sched.step()
    assert built == [1] and len(single.launches) == 1
    b = sched.submit(RequestHandle([7, 3], SamplingParams(max_tokens=5)))
    launches = len(slots.launches)
    sched.step()
    assert len(slots.launches) == launches + 1  # two requests: the slots' plan
    drain(sched)
    assert built == [1] and len(single.launches) > 1  # alone again after b ended
    assert a.result().token_ids == solo(prompt, 40)
    assert b.result().token_ids == solo([7, 3], 5)
    assert pool.num_free == 64


# ---- prompts fed through a prefill plan (models/prefill.py) -----------------------------------
class FakeChunkExecutor:
    """The prefill plan's step semantics with the fake rule: rows 0 .. n-1 are positions
    p0 .. p0+n-1 of one sequence; row i sees the cache before p0 and rows 0 .. i-1 of the
    chunk; the rows' cache writes land after every row has read; TOKENS_OUT holds the token
    of row n-1. Shares the decode fake's KV cache."""

    def __init__(self, chunk: int, cache: list[int]) -> None:
        self.io = {io.PROMPT: torch.zeros(1, chunk, dtype=torch.int32),
                   io.POSITIONS: torch.zeros(1, dtype=torch.int32),
                   io.CHUNK: torch.zeros(1, dtype=torch.int32),
                   io.HEAD_POSITION: torch.zeros(1, dtype=torch.int32),
                   io.PAGE_TABLE: torch.zeros(1, MAX_PAGES, dtype=torch.int32),
                   io.SAMPLING: torch.zeros(1, io.SAMPLING_WORDS, dtype=torch.int32),
                   io.TOKENS_OUT: torch.full((1, 1), -7, dtype=torch.int32)}
        self.cache = cache
        self.launches: list[int] = []  # rows fed per launch

    write = FakeExecutor.write
    read = FakeExecutor.read
    _slot = FakeExecutor._slot

    def run(self, num_steps: int = 1) -> None:
        assert num_steps == 1
        n, p0 = int(self.io[io.CHUNK][0]), int(self.io[io.POSITIONS][0])
        assert int(self.io[io.HEAD_POSITION][0]) == p0 + n - 1
        ids = self.io[io.PROMPT][0, :n].tolist()
        self.launches.append(n)
        history = []
        for q in range(p0):
            slot = self._slot(0, q)
            token = self.cache[slot] if slot is not None else -1
            history.append(token if token >= 0 else POISON)
        out = None
        for i, token in enumerate(ids):
            out = rule(token, p0 + i, weigh(history + ids[:i]))
        for i, token in enumerate(ids):
            slot = self._slot(0, p0 + i)
            if slot is not None:
                self.cache[slot] = token
        self.io[io.TOKENS_OUT][0, 0] = out


def make_chunked(slots: int, steps: int, chunk: int, pages: int = 200
                 ) -> tuple[Scheduler, FakeExecutor, FakeChunkExecutor]:
    ex = StreamOrdered(FakeExecutor(slots, steps, pages))
    prefill = StreamOrdered(FakeChunkExecutor(chunk, ex.cache), ex.stream)
    sched = Scheduler(ex, PagePool(pages, PAGE), slots, MAX_PAGES, steps,
                      chunk=lambda: (prefill, chunk), chunk_size=chunk)
    return sched, ex, prefill


@pytest.mark.parametrize("chunk", [1, 5, 16])
@pytest.mark.parametrize("seed", range(3))
def test_prompts_through_a_prefill_plan_get_their_solo_tokens(chunk: int, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    sched, ex, prefill = make_chunked(3, 4, chunk)
    handles = []
    for _ in range(7):
        n = int(torch.randint(1, 40, (1,), generator=gen))
        prompt = torch.randint(0, VOCAB, (n,), generator=gen).tolist()
        m = int(torch.randint(1, 8, (1,), generator=gen))
        handles.append((prompt, m, sched.submit(RequestHandle(prompt,
                                                             SamplingParams(max_tokens=m)))))
        sched.step()
    drain(sched)
    for prompt, m, h in handles:
        assert h.result().token_ids == solo(prompt, m)
    assert prefill.launches and max(prefill.launches) <= chunk
    assert sched.pool.num_free == 200


def test_prefill_launches_alternate_with_the_decoding_rows() -> None:
    sched, ex, prefill = make_chunked(2, 4, 8)
    a = sched.submit(RequestHandle([3, 1, 4], SamplingParams(max_tokens=40)))
    sched.step()
    long = [(5 * i + 2) % VOCAB for i in range(30)]
    b = sched.submit(RequestHandle(long, SamplingParams(max_tokens=3)))
    kinds = []
    while sched.has_work():
        before = (len(ex.launches), len(prefill.launches))
        sched.step()
        kinds.append("decode" if len(ex.launches) > before[0] else "prefill")
    # 30 positions, 8 a prefill launch while more than a launch's 4 steps are left; the decode
    # launches between them leave the prompt alone (so it is cut as in its solo run): 8 + 8 +
    # 8 + 6
    assert kinds[:7] == ["prefill", "decode"] * 3 + ["prefill"]
    assert prefill.launches == [8, 8, 8, 6]
    assert a.result().token_ids == solo([3, 1, 4], 40)
    assert b.result().token_ids == solo(long, 3)


def test_a_prompt_is_cut_into_the_same_chunks_whatever_runs_beside_it() -> None:
    """The chunk and decode launches round differently, so a request's tokens equal its solo
    run's only if its prompt is fed the same way: chunks while more than a launch is left."""
    long = [(7 * i + 1) % VOCAB for i in range(30)]
    cuts = []
    for others in (0, 3):
        sched, ex, prefill = make_chunked(4, 4, 8)
        for k in range(others):
            sched.submit(RequestHandle([k + 1, 2, 3, 4][: k + 2], SamplingParams(max_tokens=9)))
            sched.step()
        b = sched.submit(RequestHandle(long, SamplingParams(max_tokens=3)))
        drain(sched)
        assert b.result().token_ids == solo(long, 3)
        cuts.append(list(prefill.launches))
    assert cuts == [[8, 8, 8, 6], [8, 8, 8, 6]]


def test_a_prompt_being_chunked_does_not_send_the_others_to_the_wide_plan() -> None:
    """With both a prefill plan and a wide plan: the decode launches between chunks hold only
    the decoding request, which fits the slots' own plan (a review found them on the 12-row
    plan, because the chunked prompt was counted as needing rows)."""
    pool = PagePool(200, PAGE)
    stream = Stream()
    narrow, wide = FakeExecutor(2, 4, 200), FakeExecutor(12, 4, 200)
    wide.cache = narrow.cache
    prefill = StreamOrdered(FakeChunkExecutor(8, narrow.cache), stream)
    narrow, wide = StreamOrdered(narrow, stream), StreamOrdered(wide, stream)
    sched = Scheduler(narrow, pool, 2, MAX_PAGES, 4, wide=lambda: (wide, 12),
                      chunk=lambda: (prefill, 8), chunk_size=8)
    a = sched.submit(RequestHandle([3, 1, 4], SamplingParams(max_tokens=40)))
    sched.step()
    long = [(5 * i + 2) % VOCAB for i in range(30)]
    b = sched.submit(RequestHandle(long, SamplingParams(max_tokens=3)))
    drain(sched)
    assert prefill.launches == [8, 8, 8, 6] and not wide.launches
    assert a.result().token_ids == solo([3, 1, 4], 40)
    assert b.result().token_ids == solo(long, 3)


def test_a_prefill_plan_needs_its_chunk_size() -> None:
    ex = FakeExecutor(2, 4, 64)
    with pytest.raises(ValueError, match="chunk_size"):
        Scheduler(ex, PagePool(64, PAGE), 2, MAX_PAGES, 4, chunk=lambda: (ex, 8))
