"""One tiny-model server process for the module-independent API tests (session scope: start-up
costs a few seconds), the tiny checkpoint it serves, and an in-process engine on the same weights
as the oracle of its tokens."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from mpk.engine import Engine
from mpk.engine.requests import SamplingParams
from mpk.models import get_preset, random_weights
from mpk.server.options import DEFAULT_STEPS_PER_LAUNCH
from tests.server.server_process import ServerProcess
from tests.server.tiny_checkpoint import PRESET, SEED, byte_tokenizer, write_tiny_checkpoint

API_KEY = "test-key-123"
MODEL = "tiny"
MAX_SEQ_LEN = 512
MAX_BATCH = 8


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny-checkpoint"))


@pytest.fixture(scope="session")
def server(tiny_checkpoint: Path) -> Iterator[ServerProcess]:
    proc = ServerProcess(["--checkpoint", str(tiny_checkpoint), "--served-model-name", MODEL,
                          "--max-batch", str(MAX_BATCH), "--max-seq-len", str(MAX_SEQ_LEN)],
                         api_key=API_KEY)
    yield proc
    proc.stop()


class Oracle:
    """Greedy ids and text of the served model, computed in this process by an engine with the
    server's options on the same path: a prompt longer than a launch goes through the prefill
    plan, whose rmsnorm rounds as Hugging Face's (an op of its own) where the decode plan's
    fused prologue rounds the folded weight (tasks/linear/task.py), so the two paths agree only
    up to bf16 rounding."""

    def __init__(self) -> None:
        cfg = get_preset(PRESET)
        self.engine = Engine(cfg, random_weights(cfg, seed=SEED), backend="cpu",
                             max_seq_len=MAX_SEQ_LEN, steps_per_launch=DEFAULT_STEPS_PER_LAUNCH,
                             progress=False)
        self.tokenizer = byte_tokenizer()

    def ids(self, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        self.engine.start(max_batch=MAX_BATCH)
        try:
            handles = [self.engine.submit(p, SamplingParams(max_tokens=max_tokens))
                       for p in prompts]
            return [h.result().token_ids for h in handles]
        finally:
            self.engine.stop()

    def text(self, prompt: str, max_tokens: int) -> str:
        ids = self.ids([self.tokenizer.encode(prompt).ids], max_tokens)[0]
        return self.tokenizer.decode(ids)


@pytest.fixture(scope="session")
def oracle() -> Oracle:
    return Oracle()
