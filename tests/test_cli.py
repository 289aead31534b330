"""The `mpk` command line, run in-process (plus one real subprocess for the entry point)."""

from __future__ import annotations

import json
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

from mpk.cli import main
from mpk.models import get_preset, random_weights
from mpk.models.reference import ReferenceModel
from mpk.testing import greedy_mismatches


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    try:
        code = main(list(argv))
    except SystemExit as e:  # argparse: --help, usage errors
        code = int(e.code or 0)
    out, err = capsys.readouterr()
    return code, out, err


def test_help_lists_the_commands(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "--help")
    assert code == 0
    for word in ("generate", "plan", "check", "tiny-qwen3"):
        assert word in out


@pytest.mark.parametrize("command", ["generate", "plan", "check"])
def test_each_command_has_examples(capsys: pytest.CaptureFixture[str], command: str) -> None:
    code, out, _ = run(capsys, command, "--help")
    assert code == 0
    assert "examples:" in out and f"mpk {command} --model" in out


def test_no_command_prints_help_and_fails(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(capsys)
    assert code == 2 and "generate" in err


def test_generate_json(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, "generate", "--model", "tiny-qwen3", "--backend", "cpu",
                         "--max-new-tokens", "4", "--json")
    assert code == 0
    result = json.loads(out)  # exactly one JSON object on stdout
    assert result["model"] == "tiny-qwen3" and result["backend"] == "cpu"
    assert result["random_weights"] is True
    assert len(result["token_ids"]) == 1 and len(result["token_ids"][0]) == 4
    timings = set(result["timings"])
    assert {"compile_s", "load_s", "prefill_s", "decode_s", "ms_per_token"} <= timings
    assert "random weights" in err


def test_generate_batch_matches_the_reference(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "generate", "--model", "tiny-llama", "--backend", "cpu",
                       "--prompt-ids", "5,6,7", "--prompt-ids", "9", "--max-new-tokens", "5",
                       "--weights-seed", "3", "--steps-per-launch", "4", "--json")
    assert code == 0
    cfg = get_preset("tiny-llama")
    ref = ReferenceModel(cfg, random_weights(cfg, seed=3), max_seq=16)
    assert not greedy_mismatches(ref, [[5, 6, 7], [9]], json.loads(out)["token_ids"])


def test_generate_feeds_a_long_prompt_on_the_prefill_plan(capsys: pytest.CaptureFixture[str]
                                                          ) -> None:
    ids = ",".join(str(i % 200 + 1) for i in range(40))
    base = ("generate", "--model", "tiny-llama", "--backend", "cpu", "--prompt-ids", ids,
            "--max-new-tokens", "4", "--json")
    code, out, _ = run(capsys, *base, "--prefill-chunk", "64")  # 40 > 64 / 2: a chunk
    chunked = json.loads(out)
    code_rows, out, _ = run(capsys, *base)  # 40 <= 256 / 2: runs, as with no prefill plan
    default = json.loads(out)
    assert default["timings"]["steps"] == 3 + 3
    code_rows, out, _ = run(capsys, *base, "--prefill-chunk", "0")
    rows = json.loads(out)
    code_slow, out, _ = run(capsys, *base, "--prefill-chunk", "0", "--prefill-rows", "1")
    slow = json.loads(out)
    assert code == code_rows == code_slow == 0
    assert chunked["token_ids"] == rows["token_ids"] == slow["token_ids"]
    assert slow["timings"]["steps"] == 40 + 3  # one position a step
    assert rows["timings"]["steps"] == 3 + 3  # 16 positions a step, then 3 decode steps
    assert chunked["timings"]["steps"] == 1 + 3  # one prefill-plan launch of 40 positions
    code, _, err = run(capsys, "generate", "--model", "tiny-llama", "--backend", "cpu",
                       "--prefill-rows", "17")
    assert code == 2 and "prefill_rows must be at most 16" in err


def test_generate_human_output(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "generate", "--model", "tiny-qwen3", "--backend", "cpu",
                       "--max-new-tokens", "2")
    assert code == 0
    assert out.startswith("prompt 0: [1, 2, 3, 4] -> [") and "ms/token" in out


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Qwen3 checkpoint folder with a word-level tokenizer."""
    from safetensors.torch import save_file
    from tokenizers import Tokenizer, models, pre_tokenizers

    cfg = get_preset("tiny-qwen3")
    folder = tmp_path_factory.mktemp("tiny-ckpt")
    (folder / "config.json").write_text(json.dumps(cfg.to_hf()))
    save_file(random_weights(cfg, seed=5), str(folder / "model.safetensors"))
    vocab = {f"w{i}": i for i in range(cfg.vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(folder / "tokenizer.json"))
    return folder


def test_generate_from_a_checkpoint_with_text(capsys: pytest.CaptureFixture[str],
                                              checkpoint: Path) -> None:
    code, out, err = run(capsys, "generate", "--checkpoint", str(checkpoint), "--backend", "cpu",
                         "--prompt", "w3 w4 w5", "--max-new-tokens", "3", "--json")
    assert code == 0, err
    result = json.loads(out)
    assert result["random_weights"] is False and result["prompt_ids"] == [[3, 4, 5]]
    assert result["text"] == [" ".join(f"w{i}" for i in result["token_ids"][0])]
    assert "random weights" not in err


def _generate_json(capsys: pytest.CaptureFixture[str], checkpoint: Path,
                   *extra: str) -> dict:
    code, out, err = run(capsys, "generate", "--checkpoint", str(checkpoint), "--backend", "cpu",
                         "--prompt", "w3 w4 w5", "--max-new-tokens", "6", "--ignore-eos",
                         "--json", *extra)
    assert code == 0, err
    return json.loads(out)


def test_generate_samples_with_a_seed(capsys: pytest.CaptureFixture[str],
                                      checkpoint: Path) -> None:
    greedy = _generate_json(capsys, checkpoint)["token_ids"]
    sample = [_generate_json(capsys, checkpoint, "--temperature", "1.5", "--seed", str(s))
              for s in (7, 7, 8)]
    assert sample[0]["token_ids"] == sample[1]["token_ids"] != sample[2]["token_ids"]
    assert sample[0]["token_ids"] != greedy  # random weights: a flat distribution at T 1.5
    assert sample[0]["sampling"] == {"temperature": 1.5, "top_k": 0, "top_p": 1.0, "seed": 7,
                                     "stop": []}
    top1 = _generate_json(capsys, checkpoint, "--temperature", "1.5", "--top-k", "1")
    assert top1["token_ids"] == greedy  # the top-1 set is the argmax


def test_generate_stops_before_a_stop_string(capsys: pytest.CaptureFixture[str],
                                             checkpoint: Path) -> None:
    full = _generate_json(capsys, checkpoint)
    text = full["text"][0]
    stop = text.split()[2]  # the third word
    cut = _generate_json(capsys, checkpoint, "--stop", stop)
    assert cut["text"] == [text[: text.find(stop)]]
    assert cut["token_ids"][0] == full["token_ids"][0][: len(cut["token_ids"][0])]
    assert len(cut["token_ids"][0]) < len(full["token_ids"][0])  # it stopped early


@pytest.mark.parametrize(("extra", "message"), [
    (["--top-p", "0"], "top_p must be a number in (0, 1]"),
    (["--temperature", "-1"], "temperature must be"),
    (["--top-k", "-2"], "top_k must be"),
    (["--stop", "x"], "--stop needs a tokenizer"),
])
def test_bad_sampling_options(capsys: pytest.CaptureFixture[str], extra: list[str],
                              message: str) -> None:
    code, _, err = run(capsys, "generate", "--model", "tiny-qwen3", "--backend", "cpu", *extra)
    assert code == 2 and message in err and "Traceback" not in err


def test_prompt_text_without_a_tokenizer(capsys: pytest.CaptureFixture[str],
                                         checkpoint: Path, tmp_path: Path) -> None:
    code, _, err = run(capsys, "generate", "--model", "tiny-qwen3", "--backend", "cpu",
                       "--prompt", "hello")
    assert code == 2 and "needs a tokenizer" in err
    bare = tmp_path / "bare"
    bare.mkdir()
    for name in ("config.json", "model.safetensors"):
        (bare / name).write_bytes((checkpoint / name).read_bytes())
    code, _, err = run(capsys, "generate", "--checkpoint", str(bare), "--backend", "cpu",
                       "--prompt", "hello")
    assert code == 2 and "has no tokenizer.json" in err


@pytest.mark.parametrize(("args", "message"), [
    (["generate", "--checkpoint", "/nonexistent", "--backend", "cpu"], "/nonexistent"),
    (["generate", "--model", "no-such-model", "--backend", "cpu"], "no model preset"),
    (["generate", "--model", "tiny-qwen3", "--backend", "cpu", "--prompt-ids", "1,999"],
     "outside the vocabulary"),
    (["plan", "--model", "no-such-model"], "no model preset"),
])
def test_errors_are_one_line_and_exit_2(capsys: pytest.CaptureFixture[str], args: list[str],
                                        message: str) -> None:
    code, out, err = run(capsys, *args)
    assert code == 2
    lines = [line for line in err.splitlines() if line.startswith("mpk: error:")]
    assert len(lines) == 1 and message in lines[0]
    assert "Traceback" not in err and out == ""


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error without a GPU")
def test_cuda_without_a_gpu(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(capsys, "generate", "--model", "tiny-qwen3", "--backend", "cuda")
    assert code == 2
    assert err.strip() == ("mpk: error: backend 'cuda' needs a CUDA GPU, but torch sees none "
                           "(torch.cuda.is_available() is False); use backend 'cpu'")


def _one_error_line(err: str) -> str:
    """The single `mpk: error: ...` line that makes up all of stderr."""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("mpk: error: "), err
    return lines[0]


def test_usage_errors_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(capsys, "generate", "--model", "tiny-qwen3", "--prompt-ids", "a,b")
    assert code == 2 and "comma-separated integers" in _one_error_line(err)
    code, _, err = run(capsys, "generate", "--model", "tiny-qwen3", "--checkpoint", "x")
    assert code == 2 and "not allowed with" in _one_error_line(err)
    code, _, err = run(capsys, "plan", "--model", "tiny-qwen3", "--no-such-option")
    assert code == 2 and "--no-such-option" in _one_error_line(err)


@pytest.mark.parametrize(("ids", "entry"), [("1,,2", 2), ("1,2,", 3), (",1", 1), ("", 1)])
def test_prompt_ids_with_an_empty_entry(capsys: pytest.CaptureFixture[str], ids: str,
                                        entry: int) -> None:
    code, _, err = run(capsys, "generate", "--model", "tiny-qwen3", "--prompt-ids", ids)
    assert code == 2
    assert f"entry {entry} of {ids!r} is empty" in _one_error_line(err)


def test_prompt_ids_allow_spaces(capsys: pytest.CaptureFixture[str],
                                 monkeypatch: pytest.MonkeyPatch) -> None:
    from mpk.cli import build_parser

    args = build_parser().parse_args(["generate", "--model", "tiny-qwen3",
                                      "--prompt-ids", " 1, 2 ,3"])
    assert args.prompt_ids == [[1, 2, 3]]


@pytest.mark.parametrize(("layers", "message"), [
    ("5-2", "layer range '5-2' is reversed (first layer 5 > last layer 2); write 2-5"),
    ("x", "expected a layer or a range like 0-1"),
])
def test_check_layer_range_errors(capsys: pytest.CaptureFixture[str], layers: str,
                                  message: str) -> None:
    code, _, err = run(capsys, "check", "--model", "tiny-qwen3", "--layers", layers)
    assert code == 2 and message in _one_error_line(err)


@pytest.mark.parametrize("where", ["before", "after"])
def test_verbose_before_or_after_the_command(capsys: pytest.CaptureFixture[str],
                                             where: str) -> None:
    """-v shows the traceback: main re-raises the error instead of printing one line."""
    from mpk.errors import MpkError

    argv = ["plan", "--model", "no-such-model"]
    argv = ["-v", *argv] if where == "before" else [*argv, "-v"]
    with pytest.raises(MpkError, match="no model preset"):
        main(argv)
    code, _, err = run(capsys, "plan", "--model", "no-such-model")  # without -v: one line
    assert code == 2 and "no model preset" in _one_error_line(err)


def test_verbose_counts_add_up() -> None:
    """`mpk -v generate -v` is -vv (debug); the command's -v must not reset the count."""
    import logging

    from mpk.cli import build_parser
    from mpk.errors import MpkError

    args = build_parser().parse_args(["-v", "plan", "--model", "tiny-qwen3", "-v"])
    assert args.verbose + args.verbose_after == 2
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    root.handlers = []  # basicConfig only configures a root logger without handlers
    try:
        with pytest.raises(MpkError):
            main(["-v", "plan", "--model", "no-such-model", "-v"])
        assert root.level == logging.DEBUG
    finally:
        root.handlers = handlers
        root.setLevel(level)


def test_plan_tables(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "plan", "--model", "tiny-llama")
    assert code == 0
    for word in ("num_tasks", "num_counters", "ops per kind", "waits per task",
                 "busy time per SM", "predicted time per token", "compile_s"):
        assert word in out


def test_plan_json(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "plan", "--model", "tiny-qwen3", "--num-sms", "8", "--batch", "2",
                       "--json")
    assert code == 0
    plan = json.loads(out)
    assert plan["num_sms"] == 8 and plan["batch"] == 2 and plan["num_tasks"] > 0
    assert sum(plan["meta"]["waits_histogram"].values()) == plan["num_tasks"]


def test_plan_of_one_tensor_parallel_rank(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "plan", "--model", "tiny-qwen3", "--num-sms", "8", "--json")
    single = json.loads(out)
    code2, out2, _ = run(capsys, "plan", "--model", "tiny-qwen3", "--num-sms", "8", "--tp", "2",
                         "--json")
    rank = json.loads(out2)
    assert code == code2 == 0 and rank["tp"] == 2
    kinds = rank["meta"]["ops_per_kind"]
    assert kinds["allreduce"] == 2 * get_preset("tiny-qwen3").num_layers
    assert rank["meta"]["weight_bytes_per_step"] < single["meta"]["weight_bytes_per_step"]


def test_check_with_a_stub(capsys: pytest.CaptureFixture[str],
                           monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []

    def run_check(cfg, layers, backend, seed, weights=None, batch=1):
        calls.append((cfg.name, layers, backend, seed, batch))
        assert weights is None  # a preset: run_check draws the slice's random weights
        return [("layers.0.qkv", 1e-3, 1e-2, True), ("hidden", 5e-2, 1e-2, False)]

    monkeypatch.setitem(sys.modules, "mpk.check", types.SimpleNamespace(run_check=run_check))
    code, out, _ = run(capsys, "check", "--model", "tiny-qwen3", "--layers", "0-1",
                       "--backend", "cpu", "--seed", "4")
    assert code == 1  # one row failed
    assert calls == [("tiny-qwen3", range(0, 2), "cpu", 4, 1)]
    run(capsys, "check", "--model", "tiny-qwen3", "--batch", "16", "--backend", "cpu")
    assert calls[-1][-1] == 16
    assert "layers.0.qkv" in out and "1 of 2 tensors within tolerance" in out
    code, _, err = run(capsys, "check", "--model", "tiny-qwen3", "--layers", "0-5",
                       "--backend", "cpu")
    assert code == 2 and "out of range" in err


def test_check_shows_failures_first_when_rows_are_many(capsys: pytest.CaptureFixture[str],
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    rows = [(f"layers.{i}.qkv", i * 1e-4, 1e-2, True) for i in range(60)]
    rows.append(("hidden after layer 7", 0.5, 1e-2, False))
    monkeypatch.setitem(sys.modules, "mpk.check",
                        types.SimpleNamespace(run_check=lambda *a, **k: rows))
    code, out, _ = run(capsys, "check", "--model", "tiny-qwen3", "--backend", "cpu")
    assert code == 1 and "60 of 61 tensors within tolerance" in out
    assert "hidden after layer 7" in out and "failures and the 10 closest passes" in out
    assert "layers.59.qkv" in out and "layers.50.qkv" in out and "layers.49.qkv" not in out


def test_check_a_checkpoint_slice(capsys: pytest.CaptureFixture[str], checkpoint: Path,
                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """--checkpoint: run_check gets the checkpoint's own weights, layer 1 renumbered as 0."""
    import mpk.check

    seen = {}
    real = mpk.check.run_check

    def spy(cfg, layers, backend, seed, weights=None, batch=1):
        seen["weights"] = weights
        return real(cfg, layers, backend, seed=seed, weights=weights, batch=batch)

    monkeypatch.setattr(mpk.check, "run_check", spy)
    code, out, err = run(capsys, "check", "--checkpoint", str(checkpoint), "--layers", "1",
                         "--backend", "cpu", "--json")
    assert code == 0, out + err
    result = json.loads(out)
    assert result["passed"] and result["layers"] == [1, 1]
    saved = random_weights(get_preset("tiny-qwen3"), seed=5)  # what the fixture saved
    sliced = mpk.check.slice_weights(seen["weights"], range(1, 2))
    assert torch.equal(sliced["model.layers.0.mlp.up_proj.weight"],
                       saved["model.layers.1.mlp.up_proj.weight"])
    assert not any(name.startswith("model.layers.1.") for name in sliced)
    code, _, err = run(capsys, "check", "--checkpoint", str(checkpoint), "--layers", "1-2",
                       "--backend", "cpu")
    assert code == 2 and "out of range" in _one_error_line(err)


def test_check_tiny_model_on_cpu(capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("mpk.check")
    code, out, err = run(capsys, "check", "--model", "tiny-qwen3", "--layers", "0-1",
                         "--backend", "cpu")
    assert code == 0, out + err


def test_python_dash_m_entry_point() -> None:
    proc = subprocess.run([sys.executable, "-m", "mpk", "plan", "--help"], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0 and "usage: mpk plan" in proc.stdout


def test_an_error_after_a_gpu_fault_exits_without_destructors(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """A faulted CUDA context aborts the process when tensors are freed at exit (rc 134 and a
    C++ stack, thirtieth session): the CLI prints its one line, then ends the process at once."""
    exits: list[int] = []

    def exit_now(code: int) -> None:
        exits.append(code)

    def lost() -> None:  # torch.cuda after a fault inside a kernel: every call fails
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "synchronize", lost)
    monkeypatch.setattr("mpk.cli.exit_now", exit_now)
    code, _, err = run(capsys, "generate", "--model", "no-such-model")
    assert exits == [2] and code == 2
    assert err.startswith("mpk: error: no model preset")


def test_an_error_with_a_healthy_context_returns(capsys: pytest.CaptureFixture[str],
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("mpk.cli.exit_now", lambda code: pytest.fail("exit_now called"))
    code, _, err = run(capsys, "generate", "--model", "no-such-model")
    assert code == 2 and "no model preset" in err


def test_exit_now_flushes_and_skips_destructors() -> None:
    script = ("import atexit, sys\nfrom mpk.cli import exit_now\n"
              "atexit.register(lambda: print('destructors ran'))\n"
              "print('flushed', end='')\nsys.stderr.write('err')\nexit_now(3)\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 3
    assert done.stdout == "flushed" and done.stderr == "err"
