"""A random-weight preset without a tokenizer (what the H200 bench serves: qwen3-8b): prompts as
token ids, the output as ids in text form; text prompts, chat and stop strings are refused
clearly. The bench script replays a small seeded trace against it."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from mpk.engine import Engine
from mpk.models import get_preset, random_weights
from tests.server.server_process import ServerProcess

PRESET = "tiny-qwen3"
BENCH = Path(__file__).resolve().parents[2] / "scripts" / "bench_serve.py"


@pytest.fixture(scope="module")
def preset_server() -> Iterator[ServerProcess]:
    proc = ServerProcess(["--model", PRESET, "--max-batch", "4", "--max-seq-len", "256"])
    yield proc
    proc.stop()


def test_ids_in_ids_out(preset_server: ServerProcess) -> None:
    prompt = [5, 17, 3, 200]
    out = preset_server.client().completions.create(model=PRESET, prompt=prompt, max_tokens=9)
    cfg = get_preset(PRESET)
    engine = Engine(cfg, random_weights(cfg, seed=0), backend="cpu", max_seq_len=256,
                    progress=False)
    want = engine.generate([prompt], 9).token_ids[0]
    assert [int(x) for x in out.choices[0].text.split()] == want
    assert out.choices[0].text == "".join(f" {t}" for t in want)


def test_text_needs_a_tokenizer(preset_server: ServerProcess) -> None:
    client = preset_server.client()
    with pytest.raises(openai.BadRequestError, match="token ids"):
        client.completions.create(model=PRESET, prompt="hello", max_tokens=1)
    with pytest.raises(openai.BadRequestError, match="tokenizer"):
        client.chat.completions.create(model=PRESET, messages=[{"role": "user",
                                                                "content": "hi"}])
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=PRESET, prompt=[1, 2], max_tokens=4, stop="x")
    assert info.value.response.json()["error"]["param"] == "stop"


def test_bench_script_replays_a_trace(preset_server: ServerProcess) -> None:
    n = 12
    run = subprocess.run(
        [sys.executable, str(BENCH), "--url", preset_server.base_url, "--num-requests", str(n),
         "--rate", "40", "--prompt-len", "4:40", "--output-len", "4:24", "--seed", "3",
         "--json"], capture_output=True, text=True, timeout=600, check=False)
    assert run.returncode == 0, run.stdout + run.stderr
    report = json.loads(run.stdout)
    assert (report["requests"], report["completed"], report["failed"]) == (n, n, 0)
    assert report["model"] == PRESET and report["output_tokens"] >= 4 * n
    for key in ("ttft", "inter_token", "tpot", "e2e"):
        assert 0 <= report[key]["p50_ms"] <= report[key]["p99_ms"], report
