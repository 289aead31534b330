"""attention_prefill's semantics on the CPU interpreter (poisoned arena) against causal attention
written out here: each task takes two pieces of rows, one from each end of the chunk
(task.py row_pieces), and together the tasks write every row once: real rows their attention
over the positions up to their own, padding rows zeros. The same graphs run on the GPU in
tests/gpu/test_kernels_prefill.py."""

from __future__ import annotations

import pytest
import torch

from mpk.compiler.lower import compile_graph
from mpk.tasks.attention_prefill.task import row_pieces
from tests.gpu.kernel_helpers import run_on
from tests.gpu.test_kernels_prefill import prefill_attention_graph


@pytest.mark.parametrize("rows,blocks", [(64, 1), (128, 2), (128, 4), (96, 3)])
def test_the_pieces_cover_every_row_once(rows: int, blocks: int) -> None:
    covered = sorted(r for j in range(blocks) for lo, hi in row_pieces(rows, blocks, j)
                     for r in range(lo, hi))
    assert covered == list(range(rows))
    sizes = {sum(hi - lo for lo, hi in row_pieces(rows, blocks, j)) for j in range(blocks)}
    assert sizes == {rows // blocks}


def causal_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     table: torch.Tensor, start: int, prompt: int, group: int) -> torch.Tensor:
    """[prompt, KVH*G*D] fp64: row i (position start + i) over positions 0 .. start + i."""
    _, page_size, kv_heads, d = k_cache.shape
    positions = torch.arange(start + prompt)
    pages, slots = table[positions // page_size].long(), positions % page_size
    keys, values = k_cache[pages, slots].double(), v_cache[pages, slots].double()  # [L, KVH, D]
    qs = q[:prompt].double().reshape(prompt, kv_heads, group, d)
    scores = torch.einsum("ihgd,lhd->ihgl", qs, keys) * d ** -0.5
    visible = positions[None, :] <= (start + torch.arange(prompt))[:, None]
    scores = scores.masked_fill(~visible[:, None, None, :], float("-inf"))
    out = torch.einsum("ihgl,lhd->ihgd", torch.softmax(scores, dim=-1), values)
    return out.reshape(prompt, -1)


@pytest.mark.parametrize("group,chunk,blocks,start,prompt", [
    (4, 128, 2, 70, 128),   # 32-row pieces, a pass each (qwen3-8b's shape)
    (4, 128, 4, 45, 100),   # 16-row pieces sharing a pass; padding from row 100
    (2, 64, 2, 0, 64),      # the first chunk
    (3, 96, 1, 37, 96),     # one task: all rows in one piece
])
def test_every_row_attends_to_its_own_positions(group: int, chunk: int, blocks: int,
                                                start: int, prompt: int) -> None:
    graph, inputs = prefill_attention_graph(group, 64, chunk=chunk, blocks=blocks, start=start,
                                            prompt=prompt, qk_norm=False, seed=group + blocks)
    got = run_on(compile_graph(graph, num_sms=4), "cpu", inputs, ["q", "o", "k_cache",
                                                                   "v_cache"])
    want = causal_attention(got["q"], got["k_cache"], got["v_cache"],
                            inputs["page_table"][0], start, prompt, group)
    # o is rounded to bf16 once (relative error <= 2^-9) from fp32 sums (~1e-6 absolute)
    torch.testing.assert_close(got["o"][:prompt].double(), want, rtol=2 ** -8, atol=1e-5)
    assert torch.equal(got["o"][prompt:], torch.zeros_like(got["o"][prompt:]))
