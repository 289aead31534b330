"""What a caller asks of the engine and gets back: sampling parameters, request handles with a
streaming iterator of tokens, per-request statistics, and request validation.

A RequestHandle is filled by the scheduler (possibly on another thread) and read by the caller:
iterate it for tokens as they are produced, or call result() for the whole output. Every method
is thread-safe.
"""

from __future__ import annotations

import enum
import itertools
import math
import operator
import queue
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from mpk.errors import MpkError


class InvalidRequestError(MpkError):
    """A request the engine cannot run: empty prompt, bad token id, too long, bad parameters."""


class FinishReason(enum.Enum):
    LENGTH = "length"  # max_tokens reached
    STOP = "stop"  # a stop token or stop string
    CANCELLED = "cancelled"  # the caller cancelled (e.g. a client disconnected)
    ERROR = "error"  # the engine failed while the request ran


GREEDY_BELOW = 1e-5


@dataclass(frozen=True)
class SamplingParams:
    """How one request is decoded. temperature 0 (or below GREEDY_BELOW) is greedy (the
    default); otherwise tokens are drawn from softmax(logits / temperature), restricted to the
    top_k most likely tokens (0: no limit) and to the smallest set whose probability reaches
    top_p, reproducibly for a given seed (None: a seed drawn per request)."""

    max_tokens: int = 16
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()  # end the request on these ids (kept in the output)
    stop: tuple[str, ...] = ()  # end on these strings (cut from the text; needs a detokenizer)

    def __post_init__(self) -> None:
        def bad(name: str, want: str) -> InvalidRequestError:
            return InvalidRequestError(f"{name} must be {want}, got {getattr(self, name)!r}")

        if not _is_int(self.max_tokens) or self.max_tokens < 0:
            raise bad("max_tokens", "an integer >= 0")
        if not _is_number(self.temperature) or not 0 <= self.temperature <= 100:
            raise bad("temperature", "a number in [0, 100]")
        if not _is_int(self.top_k) or not 0 <= self.top_k < 2**31:
            raise bad("top_k", "an integer in [0, 2^31)")
        if not _is_number(self.top_p) or not 0 < self.top_p <= 1:
            raise bad("top_p", "a number in (0, 1]")
        if self.seed is not None and (not _is_int(self.seed) or not 0 <= self.seed < 2**63):
            raise bad("seed", "an integer in [0, 2^63) or None")
        if any(not _is_int(t) for t in self.stop_token_ids):
            raise bad("stop_token_ids", "integers")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise bad("stop", "non-empty strings")

    @property
    def greedy(self) -> bool:
        """Temperatures below GREEDY_BELOW decode greedily (as vLLM does): logits / T would
        overflow float32 and the draw would no longer be the argmax it tends to."""
        return self.temperature < GREEDY_BELOW


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return (isinstance(value, (int, float)) and not isinstance(value, bool)
            and math.isfinite(value))


@dataclass
class RequestStats:
    """Seconds on the engine's clock: when the request was submitted, admitted (got a batch slot
    and its KV pages), and when each token reached the handle."""

    submitted: float
    admitted: float | None = None
    token_times: list[float] = field(default_factory=list)

    @property
    def ttft_s(self) -> float | None:
        """Time to first token."""
        return self.token_times[0] - self.submitted if self.token_times else None

    @property
    def inter_token_s(self) -> list[float]:
        """The gaps between consecutive tokens as they reached the handle (a launch's tokens
        arrive together: zero gaps inside a launch, a launch's time between them)."""
        return [b - a for a, b in itertools.pairwise(self.token_times)]

    @property
    def tpot_s(self) -> float | None:
        """Time per output token after the first: (last - first) / (tokens - 1)."""
        if len(self.token_times) < 2:
            return None
        return (self.token_times[-1] - self.token_times[0]) / (len(self.token_times) - 1)


@dataclass(frozen=True)
class GenerationResult:
    """Generated ids per prompt (prompt excluded, a stop id kept) and where the time went.

    timings (seconds unless the key says otherwise): compile_s (plan compilation in this call,
    0 when the plan was cached), load_s (weight preparation and executor set-up paid by this
    call), prefill_s (launch time until every row had its first token), decode_s (the rest),
    ms_per_token (decode time per decode step; every step yields one token per row), steps,
    launches. texts: with a detokenizer, each output's text, cut before a stop string.
    """

    token_ids: list[list[int]]
    timings: dict[str, float] = field(default_factory=dict)
    texts: list[str] | None = None


@dataclass(frozen=True)
class RequestResult:
    token_ids: list[int]
    finish_reason: FinishReason
    stats: RequestStats
    text: str | None = None  # with a detokenizer: the output text, cut at a stop string
    error: str | None = None


_DONE = object()
_ids = itertools.count()


class RequestHandle:
    """One submitted request. Iterate for its tokens as they come; result() waits for all."""

    def __init__(self, prompt: list[int], params: SamplingParams) -> None:
        self.id = f"req-{next(_ids)}"
        self.prompt = prompt
        self.params = params
        self.stats = RequestStats(submitted=time.perf_counter())
        self._tokens: list[int] = []
        self._queue: queue.Queue[object] = queue.Queue()
        self._done = threading.Event()
        self._cancel = threading.Event()
        self._result: RequestResult | None = None

    # ---- caller side ----------------------------------------------------------------------
    def __iter__(self) -> Iterator[int]:
        """Tokens as the engine produces them (blocks until the next one or the end)."""
        while True:
            item = self._queue.get()
            if item is _DONE:
                return
            yield from item  # type: ignore[misc]  # a launch's tokens

    def cancel(self) -> None:
        """Stop the request: its slot and KV pages are freed at the next launch boundary."""
        self._cancel.set()

    @property
    def cancelled(self) -> bool:
        return self._cancel.is_set()

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def result(self, timeout: float | None = None) -> RequestResult:
        """The finished request (waits for it)."""
        if not self._done.wait(timeout):
            raise TimeoutError(f"request {self.id} is still running")
        assert self._result is not None
        return self._result

    # ---- scheduler side ---------------------------------------------------------------------
    def deliver(self, tokens: Sequence[int], now: float) -> None:
        """A launch's tokens, all produced by `now`: the reader wakes once for them (a put per
        token was most of the scheduler's host time between launches at 16 slots)."""
        if not tokens:
            return
        self._tokens.extend(tokens)
        self.stats.token_times.extend([now] * len(tokens))
        self._queue.put(tuple(tokens))

    def finish(self, reason: FinishReason, text: str | None = None,
               error: str | None = None) -> None:
        if self._done.is_set():
            return
        self._result = RequestResult(list(self._tokens), reason, self.stats, text, error)
        self._done.set()
        self._queue.put(_DONE)

    @property
    def tokens(self) -> list[int]:
        return list(self._tokens)

    @property
    def num_tokens(self) -> int:
        """len(tokens), without the copy (the scheduler asks once per delivered token)."""
        return len(self._tokens)

    @property
    def last_token(self) -> int:
        """The last token delivered (there must be one)."""
        return self._tokens[-1]


def validate_prompt(prompt: Sequence[int], vocab_size: int, index: int = 0) -> list[int]:
    """The prompt as a list of ints, or InvalidRequestError naming the offending entry."""
    if isinstance(prompt, (str, bytes)) or not isinstance(prompt, Sequence):
        raise InvalidRequestError(f"prompt {index} is {type(prompt).__name__}, expected a list "
                                  f"of token ids")
    ids = []
    for i, tok in enumerate(prompt):
        try:
            value = operator.index(tok)  # numpy / torch integers accepted
        except TypeError:
            value = None
        if isinstance(tok, bool) or value is None or not 0 <= value < vocab_size:
            raise InvalidRequestError(f"prompt {index}, position {i}: token id {tok!r} is "
                                      f"outside the vocabulary [0, {vocab_size})")
        ids.append(value)
    if not ids:
        raise InvalidRequestError(f"prompt {index} is empty: every prompt needs at least one "
                                  f"token")
    return ids


def positions_needed(prompt_len: int, max_tokens: int) -> int:
    """KV positions a request writes: its prompt and every generated token but the last."""
    return prompt_len + max(max_tokens, 1) - 1
