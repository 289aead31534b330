"""Floor arithmetic, the result table, and run_bench's refusal without CUDA (CPU tests); one
end-to-end run of the compiled baseline on a GPU."""

from __future__ import annotations

import pytest
import torch

from mpk.bench.runner import (format_table, run_bench, uniform_routing_bytes_per_step,
                              weight_bytes_per_token)
from mpk.bench.timing import (floor_ms, percent_of_floor, percentile, read_bandwidth_probe,
                              summarize, time_decode)
from mpk.errors import UnsupportedError
from mpk.models.config import get_preset

#: A result as run_bench returns it (numbers from the H200 reference table, Qwen3-0.6B).
RECORDED = {
    "model": "qwen3-0.6b", "batch": 1, "new_tokens": 200, "prompt_len": 16, "max_seq": 1024,
    "seed": 0, "repeats": 3, "device": "NVIDIA H200", "torch": "2.11.0",
    "bytes_per_token": 1_192_099_840, "bandwidth_bytes_per_s": 4.0e12, "floor_ms": 0.298,
    "systems": {
        "torch.compile": {"median_ms": 1.86, "p10_ms": 1.85, "p90_ms": 1.88,
                          "runs_ms": [1.85, 1.86, 1.88], "tokens_per_s": 537.6,
                          "pct_of_floor": 16.0, "compile_s": 41.2},
        "mpk": {"median_ms": 0.40, "p10_ms": 0.39, "p90_ms": 0.41,
                "runs_ms": [0.39, 0.40, 0.41], "tokens_per_s": 2500.0, "pct_of_floor": 74.6},
    },
    "ratio_baseline_over_mpk": 4.65, "prompt": [1, 2, 3], "baseline_tokens": [4, 5],
}


def test_bytes_per_token_matches_reference_table() -> None:
    """Tied: the whole table counts (it is the lm_head); untied: the embedding does not."""
    tied = get_preset("qwen3-0.6b")
    assert weight_bytes_per_token(tied) == tied.weight_bytes
    assert round(weight_bytes_per_token(get_preset("qwen3-8b")) / 1e9, 2) == 15.14
    assert round(weight_bytes_per_token(get_preset("llama-3.1-8b")) / 1e9, 2) == 15.01
    assert round(weight_bytes_per_token(get_preset("llama-3.2-1b")) / 1e9, 2) == 2.47


def test_bytes_per_token_of_a_moe_model_counts_the_chosen_experts() -> None:
    """qwen3-30b-a3b reads 8 of its 128 experts per MoE layer at least (the floor at any batch),
    not its 61 GB of weights: 2.46 GB outside the experts plus 48 x 8 x 9.4 MB."""
    cfg = get_preset("qwen3-30b-a3b")
    untied_embed = cfg.vocab_size * cfg.hidden_size
    assert weight_bytes_per_token(cfg) == 2 * (cfg.active_params - untied_embed)
    assert round(weight_bytes_per_token(cfg) / 1e9, 2) == 6.08
    assert weight_bytes_per_token(cfg) < cfg.weight_bytes / 10


def test_uniform_routing_bytes_count_the_distinct_experts_of_a_batch() -> None:
    """At batch 8 the rows of qwen3-30b-a3b choose 128 (1 - (120/128)^8) = 51.6 distinct experts
    per layer on average, not 8: 43.6 x 48 x 9.44 MB more than at batch 1. Dense models and batch
    1 read what weight_bytes_per_token says."""
    cfg = get_preset("qwen3-30b-a3b")
    assert uniform_routing_bytes_per_step(cfg, 1) == weight_bytes_per_token(cfg)
    per_expert = 3 * 2048 * 768 * 2
    extra = 128 * (1 - (120 / 128) ** 8) - 8
    assert uniform_routing_bytes_per_step(cfg, 8) == round(
        weight_bytes_per_token(cfg) + 48 * extra * per_expert)
    assert round(uniform_routing_bytes_per_step(cfg, 8) / 1e9, 1) == 25.8
    dense = get_preset("qwen3-0.6b")
    assert uniform_routing_bytes_per_step(dense, 16) == weight_bytes_per_token(dense)


def test_floor_and_percent() -> None:
    assert floor_ms(4e9, 4e12) == pytest.approx(1.0)
    assert floor_ms(1.19e9, 4.0e12) == pytest.approx(0.2975)
    assert percent_of_floor(0.3, 1.2) == pytest.approx(25.0)
    assert percent_of_floor(0.5, 0.5) == pytest.approx(100.0)
    with pytest.raises(ValueError):
        floor_ms(1.0, 0.0)
    with pytest.raises(ValueError):
        percent_of_floor(1.0, 0.0)


def test_percentiles() -> None:
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert percentile([0.0, 10.0], 10) == pytest.approx(1.0)
    assert percentile([5.0], 90) == 5.0
    s = summarize([float(i) for i in range(11)])
    assert (s["median_ms"], s["p10_ms"], s["p90_ms"]) == (5.0, 1.0, 9.0)
    with pytest.raises(ValueError):
        percentile([], 50)


def test_format_table_renders_recorded_result() -> None:
    text = format_table(RECORDED)
    for needle in ("qwen3-0.6b", "NVIDIA H200", "torch.compile", "mpk", "floor", "1.860",
                   "0.400", "0.298", "16%", "75%", "41.2", "538", "2500", "4.65x", "1.192 GB",
                   "4.00 TB/s"):
        assert needle in text, (needle, text)
    systems = {"torch.compile": RECORDED["systems"]["torch.compile"]}
    baseline_only = {**RECORDED, "systems": systems, "ratio_baseline_over_mpk": None}
    text = format_table(baseline_only)
    assert "mpk " not in text and "speed-up" not in text and "WARNING" not in text
    skipped = {**RECORDED, "systems": {"torch.compile": {**systems["torch.compile"],
                                                         "cudagraph_skips": 1}}}
    assert "skipped CUDA graphs" in format_table(skipped)
    assert "routed uniformly" not in format_table(RECORDED)  # a dense model: no such line


def test_format_table_names_the_uniform_routing_floor_of_a_moe_batch() -> None:
    """A MoE step of 8 rows: the note gives the uniform-routing bytes and floor beside the
    table's K-expert floor."""
    moe = {**RECORDED, "batch": 8, "bytes_per_token": 6.084e9,
           "uniform_routing_bytes_per_step": 25.8e9, "uniform_routing_floor_ms": 6.324}
    text = format_table(moe)
    assert "a step of batch 8 reads 25.800 GB: floor 6.324 ms" in text, text


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA error")
def test_needs_cuda() -> None:
    cfg = get_preset("tiny-qwen3")
    with pytest.raises(UnsupportedError, match="CUDA"):
        run_bench(cfg)
    with pytest.raises(UnsupportedError, match="CUDA"):
        time_decode(lambda n: None, 10)
    with pytest.raises(UnsupportedError, match="CUDA"):
        read_bandwidth_probe()


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["tiny-qwen3", "tiny-llama"])
def test_run_bench_on_gpu(name: str) -> None:
    """The compiled, CUDA-graphed baseline gives the eager model's tokens, and a fake MPK step
    is timed and compared."""
    from mpk.bench.baseline import DecodeLoop, StaticDecoder
    from mpk.bench.runner import bench_prompt
    from mpk.models.weights import random_weights

    cfg = get_preset(name)
    weights = random_weights(cfg, 0, "cuda")
    calls: list[int] = []
    result = run_bench(cfg, new_tokens=20, weights=weights, max_seq=64, check_tokens=12,
                       mpk_step=lambda n: calls.append(n))
    assert calls == [20] * 4  # warm-up + 3 repeats
    eager = DecodeLoop(StaticDecoder(cfg, weights, 64), bench_prompt(cfg, 1, 16, 0).cuda(), 64)
    eager.prefill()
    assert result["baseline_tokens"] == eager.generate(12)[0].tolist()
    base = result["systems"]["torch.compile"]
    assert base["cudagraph_skips"] == 0
    assert 0 < base["p10_ms"] <= base["median_ms"] <= base["p90_ms"]
    assert result["ratio_baseline_over_mpk"] > 0 and result["bandwidth_bytes_per_s"] > 1e11
    print(format_table(result))
