"""The prefill graph: one launch runs a chunk of up to C prompt positions of ONE sequence
through the model at once (the decode graph feeds at most one position per batch row a step).

Rows are positions p0 .. p0+C-1 (p0 = POSITIONS[0]; CHUNK[0] = n of them are prompt, the rest
padding). Each layer: the input norm (`rmsnorm` over the rows), the qkv projection (a `gemm`),
`rope_append` (the chunk's queries and keys normed and rotated, its keys and values appended to
the sequence's pages), `attention_prefill` (causal over the sequence's cached positions, the
chunk's included), o_proj + residual, the post norm, gate_up (silu*mul
epilogue), down + residual; then the last prompt row (`take_row`) goes through the final norm,
lm_head and the sampler, drawing at HEAD_POSITION: the request's first token when the chunk ends
its prompt. The weights and KV-cache tensors are the decode graph's (the same names), so the
engine binds one KV cache to both plans.

Dense models, one GPU only (a MoE or tensor-parallel engine feeds prompts as runs of its decode
batch); `supports_prefill` says whether a backend runs a model's prefill plans (on CUDA: head
dims up to attention_prefill's CUDA_MAX_HEAD_DIM, the registers of its tile).
"""

from __future__ import annotations

from dataclasses import dataclass

from mpk.dtypes import DType
from mpk.errors import UnsupportedError
from mpk.graph.graph import Graph
from mpk.models import decode_io as io
from mpk.models.builder import choose_split, lm_head
from mpk.models.config import ModelConfig
from mpk.tasks.attention_prefill.task import CUDA_MAX_HEAD_DIM
from mpk.tasks.gemm.task import ALIGN as GEMM_ALIGN
from mpk.tasks.gemm.task import BM as GEMM_ROWS  # the CUDA tile's height: blocks of whole tiles
from mpk.tasks.gemm.task import BN_NARROW, BN_WIDE, tile_width
from mpk.tensors import Role

BF16, F32, I32 = DType.BF16, DType.F32, DType.I32
QUERY_BLOCK = 64  # prompt rows per attention_prefill task (when it divides the chunk)
PREFILL_KINDS = ("gemm", "rope_append", "attention_prefill", "take_row")
# A BN_WIDE tile's time in BN_NARROW tiles: twice the FLOPs at the rate
# scripts/wgmma_gemm_probe.cu measured for each (413 against 318 TFLOP/s on one wave, H200).
WIDE_TILE_COST = 2 * 318 / 413


@dataclass(frozen=True)
class PrefillShape:
    chunk: int  # C: prompt positions per launch
    page_size: int = 16
    max_pages: int = 64
    num_pages: int = 64
    segments: int = 1  # S: sequences a launch may hold, each from a QUERY_BLOCK boundary

    def __post_init__(self) -> None:
        if min(self.chunk, self.page_size, self.max_pages, self.num_pages, self.segments) <= 0:
            raise UnsupportedError(f"invalid prefill shape {self}")
        if self.segments > 1 and (self.chunk % QUERY_BLOCK or
                                  self.segments > self.chunk // QUERY_BLOCK):
            raise UnsupportedError(f"{self.segments} segments need a chunk of at least as many "
                                   f"{QUERY_BLOCK}-row blocks, got {self.chunk} rows")

    @property
    def max_seq_len(self) -> int:
        return self.max_pages * self.page_size


def supports_prefill(cfg: ModelConfig, backend: str) -> bool:
    """Whether `backend` runs prefill plans of `cfg`: dense models whose projections' sizes
    are multiples of 8 (the gemm kind's 16-byte rows and output ranges), on kinds with kernels.
    Other models feed prompts as runs of the decode batch."""
    width = cfg.num_kv_heads * (cfg.group + 2) * cfg.head_dim
    sizes = (cfg.hidden_size, cfg.intermediate_size, width, cfg.num_heads * cfg.head_dim)
    if cfg.is_moe or any(size % GEMM_ALIGN for size in sizes):
        return False
    if backend == "cpu":
        return True
    from mpk.backends.cuda.codegen import missing_kernels

    return cfg.head_dim <= CUDA_MAX_HEAD_DIM and not missing_kernels(PREFILL_KINDS)


def prefill_segments(backend: str, chunk: int, slots: int) -> int:
    """How many prompts one launch of a chunk-`chunk` prefill plan packs for an engine of
    `slots` requests: one per 64-row block, at most one per slot, on backends whose kernels
    take segments (the interpreter; the CUDA kernels read one: TaskKind.cuda_unsupported)."""
    if backend != "cpu" or chunk % QUERY_BLOCK:
        return 1
    return max(1, min(slots, chunk // QUERY_BLOCK))


def build_prefill_graph(cfg: ModelConfig, shape: PrefillShape, num_sms: int) -> Graph:
    if cfg.is_moe:
        raise UnsupportedError("prefill plans cover dense models; MoE prompts run as decode runs")
    g = Graph()
    c, h, s = shape.chunk, cfg.hidden_size, shape.segments
    for name, dims in ((io.PROMPT, (1, c)), (io.POSITIONS, (s,)), (io.CHUNK, (s,)),
                       (io.HEAD_POSITION, (s,)), (io.PAGE_TABLE, (s, shape.max_pages)),
                       (io.TOKENS_OUT, (1, s)), (io.SAMPLING, (s, io.SAMPLING_WORDS)),
                       *(((io.STARTS, (s,)),) if s > 1 else ())):
        g.add_tensor(name, dims, I32, Role.IO)
    g.add_tensor(io.TOKENS, (s,), I32, Role.ACTIVATION)
    g.add_tensor("row_tokens", (c,), I32, Role.ACTIVATION)  # unread: every row is forced
    g.add_tensor("embed", (cfg.vocab_size, h), BF16, Role.WEIGHT)
    g.add_tensor("rope", (shape.max_seq_len, cfg.head_dim), F32, Role.WEIGHT)
    g.add_tensor("hidden", (c, h), BF16, Role.ACTIVATION)
    g.add_op("embedding", "embed", (choose_split(h, num_sms, 64),),
             {"tokens": "row_tokens", "prompt": io.PROMPT, "table": "embed", "out": "hidden"})
    for layer in range(cfg.num_layers):
        _layer(g, cfg, shape, num_sms, layer)
    g.add_tensor("last_hidden", (s, h), BF16, Role.ACTIVATION)
    g.add_op("take_row", "last_row", (1,), {"x": "hidden", "chunk": io.CHUNK,
                                            "out": "last_hidden", **_starts(shape)})
    lm_head(g, cfg, s, num_sms, "last_hidden", io.HEAD_POSITION, None)
    return g


def _starts(shape: PrefillShape) -> dict[str, str]:
    """The STARTS operand of the segment-aware ops (one segment: none, it starts at row 0)."""
    return {"starts": io.STARTS} if shape.segments > 1 else {}


def _gemm_grid(outputs: int, chunk: int, num_sms: int, silu: bool = False
               ) -> tuple[int, int]:
    """(output ranges, row blocks) of a gemm: of the grids for the kernel's narrow and wide
    tiles (`_gemm_grid_for`), the one whose busiest SM takes the least tile time."""
    def cost(grid: tuple[int, int]) -> float:
        ranges, blocks = grid
        width = -(-outputs // ranges)
        tile = WIDE_TILE_COST if tile_width(width, silu) == BN_WIDE else 1.0
        tiles = -(-chunk // GEMM_ROWS) // blocks
        return -(-ranges * blocks // num_sms) * tiles * tile

    grids = [_gemm_grid_for(outputs, chunk, num_sms, bn // 2 if silu else bn)
             for bn in (BN_NARROW, BN_WIDE)]
    return min(grids, key=lambda g: (cost(g), g[0] * g[1]))


def _gemm_grid_for(outputs: int, chunk: int, num_sms: int, columns: int) -> tuple[int, int]:
    """(output ranges, row blocks) of a gemm: ranges of `columns` outputs (one tile wide) and
    row blocks of whole GEMM_ROWS-row tiles, as many as make the busiest SM's tiles fewest
    (ceil(tasks / SMs) tasks of tiles / blocks tiles each), of those the fewest (a task costs
    a few microseconds of its own). The fewest blocks that merely give every SM a task left
    qwen3-8b's qkv and gate_up at C 1024 with 4 and 16 tiles on the busiest SM where 3 and 12
    do. Narrower ranges (down to 8 outputs) where even one row tile per task leaves SMs idle,
    as many as keep one task per SM: a task narrower than the tile costs a whole tile, so one
    task past the SM count doubles the busiest SM's time."""
    ranges = -(-outputs // columns)
    tiles = -(-chunk // GEMM_ROWS)

    def busiest(blocks: int) -> int:
        return -(-ranges * blocks // num_sms) * (tiles // blocks)

    blocks = min((b for b in range(1, tiles + 1) if tiles % b == 0),
                 key=lambda b: (busiest(b), b))
    if ranges * tiles < num_sms:
        blocks = tiles
        ranges = max(ranges, min(num_sms // blocks, outputs // 8))
    return ranges, blocks


def _norm(g: Graph, name: str, x: str, weight: str, out: str, chunk: int, num_sms: int,
          eps: float) -> None:
    g.add_op("rmsnorm", name, (choose_split(chunk, num_sms, 1),),
             {"x": x, "weight": weight, "out": out}, eps=eps)


def _layer(g: Graph, cfg: ModelConfig, shape: PrefillShape, num_sms: int, layer: int) -> None:
    p = f"layers.{layer}."
    c, h, d, kvh, group = (shape.chunk, cfg.hidden_size, cfg.head_dim, cfg.num_kv_heads,
                           cfg.group)
    width, inter = kvh * (group + 2) * d, cfg.intermediate_size
    weights = {"input_norm": (h,), "qkv_weight": (width, h), "o_weight": (h, kvh * group * d),
               "post_norm": (h,), "gate_up_weight": (2, inter, h), "down_weight": (h, inter)}
    if cfg.qk_norm:
        weights.update(q_norm=(d,), k_norm=(d,))
    for name, dims in weights.items():
        g.add_tensor(p + name, dims, BF16, Role.WEIGHT)
    cache = (shape.num_pages, shape.page_size, kvh, d)
    g.add_tensor(io.k_cache(layer), cache, BF16, Role.IO)
    g.add_tensor(io.v_cache(layer), cache, BF16, Role.IO)
    for name, cols in (("normed", h), ("qkv", width), ("q", kvh * group * d),
                       ("attn", kvh * group * d), ("act", inter)):
        g.add_tensor(p + name, (c, cols), BF16, Role.ACTIVATION)
    eps = cfg.rms_eps
    _norm(g, p + "input_norm", "hidden", p + "input_norm", p + "normed", c, num_sms, eps)
    g.add_op("gemm", p + "qkv", _gemm_grid(width, c, num_sms),
             {"x": p + "normed", "weight": p + "qkv_weight", "out": p + "qkv"})
    seq = {"rope": "rope", "positions": io.POSITIONS, "chunk": io.CHUNK,
           "page_table": io.PAGE_TABLE, "k_cache": io.k_cache(layer),
           "v_cache": io.v_cache(layer), **_starts(shape)}
    prep = {**seq, "qkv": p + "qkv", "q": p + "q"}
    if cfg.qk_norm:
        prep.update(q_norm=p + "q_norm", k_norm=p + "k_norm")
    blocks = c // QUERY_BLOCK if c % QUERY_BLOCK == 0 else 1
    g.add_op("rope_append", p + "rope_append", (kvh, blocks), prep, eps=eps)
    g.add_op("attention_prefill", p + "attention", (kvh, blocks),
             {**seq, "q": p + "q", "out": p + "attn"})
    g.add_op("gemm", p + "o_proj", _gemm_grid(h, c, num_sms),
             {"x": p + "attn", "weight": p + "o_weight", "residual": "hidden", "out": "hidden"})
    _norm(g, p + "post_norm", "hidden", p + "post_norm", p + "normed", c, num_sms, eps)
    g.add_op("gemm", p + "gate_up", _gemm_grid(inter, c, num_sms, silu=True),
             {"x": p + "normed", "weight": p + "gate_up_weight", "out": p + "act"},
             epilogue="silu_mul")
    g.add_op("gemm", p + "down", _gemm_grid(h, c, num_sms),
             {"x": p + "act", "weight": p + "down_weight", "residual": "hidden", "out": "hidden"})
