"""MPK's side of `mpk bench` on the CPU interpreter: its greedy tokens cover the same positions
as the baseline's, so the bench's agreement count compares like with like."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mpk.bench.baseline import DecodeLoop, StaticDecoder
from mpk.bench.job import tokens_agree
from mpk.bench.mpk_decoder import MpkDecoder, decode_shape
from mpk.bench.runner import bench_prompt
from mpk.models.config import get_preset
from mpk.models.reference import ReferenceModel
from mpk.models.weights import random_weights
from mpk.testing import greedy_mismatches

MAX_SEQ = 64
TOKENS = 8
ROOT = Path(__file__).resolve().parents[2]


def _min_margin(ref: ReferenceModel, prompt: list[int], tokens: list[int]) -> float:
    """The smallest top-1 minus top-2 logit gap (in logits' std) along the greedy sequence."""
    ref.reset()
    logits = ref.forward(torch.tensor([prompt + tokens[:-1]]), 0)[0, len(prompt) - 1:]
    top = logits.topk(2, dim=-1).values
    return float(((top[:, 0] - top[:, 1]) / logits.std(dim=-1)).min())


# Seeds whose greedy sequences have no near-tie (margins >= 0.1 std; seed 2 of tiny-llama has
# a 0.014-std tie at the first token, where f32 and bf16 legitimately pick different tokens).
@pytest.mark.parametrize(("name", "seed"), [("tiny-qwen3", 2), ("tiny-llama", 1)])
def test_tokens_line_up_with_the_baseline(name: str, seed: int) -> None:
    cfg = get_preset(name)
    weights = random_weights(cfg, seed=seed)
    prompt = bench_prompt(cfg, 1, 6, seed=seed)
    decoder = MpkDecoder(cfg, weights, prompt, new_tokens=TOKENS, backend="cpu")
    mpk_tokens = decoder.tokens(TOKENS)
    # The reference's greedy continuation starts with the token the prompt's last step
    # produces; MPK's list must too (it used to start one token later).
    ref = ReferenceModel(cfg, weights, max_seq=MAX_SEQ)
    assert not greedy_mismatches(ref, [prompt[0].tolist()], [mpk_tokens])
    f32 = {k: v.float() for k, v in weights.items()}
    loop = DecodeLoop(StaticDecoder(cfg, f32, MAX_SEQ, dtype=torch.float32), prompt, MAX_SEQ)
    loop.prefill()
    baseline = loop.generate(TOKENS)[0].tolist()
    ref32 = ReferenceModel(cfg, weights, max_seq=MAX_SEQ, activation_dtype=torch.float32)
    assert _min_margin(ref32, prompt[0].tolist(), baseline) > 0.1  # the seed has no near-tie
    assert tokens_agree(mpk_tokens, baseline) == f"{TOKENS}/{TOKENS}", (mpk_tokens, baseline)


def test_one_token_is_the_prompts_own() -> None:
    """tokens(1) runs no decode step: the token is the one the prompt's last step produced."""
    cfg = get_preset("tiny-llama")
    weights = random_weights(cfg, seed=1)  # first two greedy tokens differ, no near-tie
    prompt = bench_prompt(cfg, 1, 6, seed=1)
    first = MpkDecoder(cfg, weights, prompt, new_tokens=4, backend="cpu").tokens(1)
    ref = ReferenceModel(cfg, weights, max_seq=MAX_SEQ)
    expected = ref.generate_greedy([prompt[0].tolist()], 2)[0]
    assert expected[0] != expected[1] and first == expected[:1]


def test_tokens_agree_counts_positions() -> None:
    assert tokens_agree([1, 2, 3, 4], [1, 2, 9, 4]) == "3/4"
    # A list shifted by one position, the old bug: comparing it at all is an error.
    with pytest.raises(ValueError, match="different lengths"):
        tokens_agree([2, 3, 4], [1, 2, 3, 4])


def test_the_decoder_compiles_the_shape_ab_decode_prebuilds() -> None:
    """scripts/ab_decode.py --build-only compiles decode_shape(...) so that the timed run finds
    its build cached: MpkDecoder must compile exactly that shape."""
    cfg = get_preset("tiny-qwen3")
    prompt = bench_prompt(cfg, 1, 6, seed=0)
    decoder = MpkDecoder(cfg, random_weights(cfg, seed=0), prompt, new_tokens=10, backend="cpu")
    assert decoder.shape == decode_shape(1, 6, 10)
    assert decode_shape(2, 16, 50) != decode_shape(2, 16, 51)  # the pages follow the tokens


@pytest.mark.nvcc
def test_ab_decode_build_only_builds_then_finds_the_build(tmp_path: Path) -> None:
    env = {**os.environ, "MPK_CACHE_DIR": str(tmp_path), "PYTHONPATH": str(ROOT / "src")}
    cmd = [sys.executable, str(ROOT / "scripts" / "ab_decode.py"), "--model", "tiny-qwen3",
           "--build-only"]
    runs = [subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600,
                           check=False) for _ in range(2)]
    for done in runs:
        assert done.returncode == 0, done.stderr[-2000:]
    first, second = (json.loads(done.stdout.strip().splitlines()[-1]) for done in runs)
    assert not first["cached"] and second["cached"]
    assert first["ptxas"]["registers"] > 0 and first["ptxas"]["spill_stores"] == 0
    assert first["splits"] == [1]
    # --split-positions: more KV splits at the same short context (another plan, another build)
    split = subprocess.run(cmd + ["--split-positions", "32", "--prompt-len", "40"], env=env,
                           capture_output=True, text=True, timeout=600, check=False)
    assert split.returncode == 0, split.stderr[-2000:]
    third = json.loads(split.stdout.strip().splitlines()[-1])
    assert not third["cached"] and third["splits"] == [3], third  # 96 positions / 32
