"""The decode step's IO contract: the graph tensors the host writes and reads around a launch
(and a prefill chunk's of S sequences (segments), models/prefill.py: PROMPT [1, C], POSITIONS [S],
PAGE_TABLE [S, max_pages], CHUNK [S], STARTS [S] (S > 1), HEAD_POSITION [S], SAMPLING [S, 5],
TOKENS_OUT [1, S]).

One module owns these names and shapes; the builder creates the tensors, the engine, bench,
profile and check drive them.

| tensor | shape | meaning |
|---|---|---|
| PROMPT | [steps_per_launch, B] i32 | row s: the token forced at local step s, NO_FORCE = embed the previous sample |
| POSITIONS | [B] i32 | each row's position at local step 0 of the launch |
| PAGE_TABLE | [B, max_pages] i32 | each row's KV pages (NO_PAGE past its allocation) |
| TOKENS_OUT | [steps_per_launch, B] i32 | row s: the token produced at local step s |
| TOKENS | [B] i32 (activation) | the last token produced: what the next step embeds unless forced |
| SAMPLING | [B, 5] i32 | per row: temperature (float bits; 0 = greedy), seed low, seed high, top_k, top_p (tasks/sampling.py owns the layout) |
| RUNS | [B, 2] i32 | per row: (index in its run, run width): a run of w rows holds w consecutive positions of one sequence per step (chunked prefill), each row moving w positions a step; (0, 1) or zeros = a row alone (tasks/runs.py owns the layout) |
| CHUNK | [S] i32 | prefill plans (models/prefill.py): how many of the chunk's C rows are segment s's prompt positions |
| STARTS | [S] i32 | prefill plans of S > 1 segments: segment s's first row (a multiple of the attention's 64-row block) |
| HEAD_POSITION | [S] i32 | prefill plans: the position of segment s's last prompt row (where its token is drawn) |
| k_cache.{l}, v_cache.{l} | [num_pages, page_size, kv_heads, head_dim] bf16 | paged KV cache of layer l |
"""

from __future__ import annotations

from mpk.tasks import runs, sampling

PROMPT = "prompt"
POSITIONS = "positions"
PAGE_TABLE = "page_table"
TOKENS_OUT = "tokens_out"
TOKENS = "tokens"
SAMPLING = "sampling"
SAMPLING_WORDS = sampling.WORDS
RUNS = "runs"
RUN_WORDS = runs.WORDS
NO_FORCE = -1  # a PROMPT entry that lets the row embed its own previous token
NO_PAGE = -1  # a PAGE_TABLE entry that holds no page: the kernels neither read nor write it
CHUNK = "chunk"
HEAD_POSITION = "head_position"
STARTS = "starts"
INPUTS = (PROMPT, POSITIONS, PAGE_TABLE, RUNS, CHUNK, HEAD_POSITION, STARTS)


def k_cache(layer: int) -> str:
    return f"k_cache.{layer}"


def v_cache(layer: int) -> str:
    return f"v_cache.{layer}"
