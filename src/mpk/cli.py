"""The `mpk` command line: its parser and entry point (the commands: cli_commands.py, cli_gpu.py,
mpk.server).

Errors that MPK expects (MpkError, missing files) print one line to stderr and exit with 2;
`-v` adds the traceback. Human output goes to stdout; `--json` prints one JSON object there.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Callable, Sequence
from typing import NoReturn

from mpk.cli_commands import DEFAULT_PROMPT_IDS, _backend, _cmd_check, _cmd_generate, _cmd_plan
from mpk.errors import MpkError

# mpk.graph.graph.DEFAULT_NUM_SMS, spelled here so `mpk --help` does not import torch;
# tests/backends/test_registry.py checks that the two agree.
PLAN_NUM_SMS = 132

EXIT_USAGE = 2



# ---- argument parsing ------------------------------------------------------------------------
def _token_ids(text: str) -> list[int]:
    entries = [x.strip() for x in text.split(",")]
    # An empty entry ("1,,2", "1,2,") is most likely a lost id, so it is an error, not skipped.
    for i, entry in enumerate(entries):
        if entry == "":
            raise argparse.ArgumentTypeError(
                f"entry {i + 1} of {text!r} is empty; expected comma-separated integers "
                f"like 1,2,3")
    try:
        return [int(x) for x in entries]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers, got {text!r}") from None


def _layer_range(text: str) -> range:
    try:
        lo, _, hi = text.partition("-")
        first, last = int(lo), int(hi or lo)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected a layer or a range like 0-1, got {text!r}") from None
    if first < 0:
        raise argparse.ArgumentTypeError(f"layer {first} in {text!r} is negative")
    if last < first:
        raise argparse.ArgumentTypeError(
            f"layer range {text!r} is reversed (first layer {first} > last layer {last}); "
            f"write {last}-{first}")
    return range(first, last + 1)


def _positive(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text}")
    return value


def _add_model_args(p: argparse.ArgumentParser, checkpoint: bool = True) -> None:
    from mpk.models.config import PRESETS

    presets = ", ".join(PRESETS)
    group = p.add_mutually_exclusive_group(required=True)
    group.add_argument("--model", metavar="PRESET",
                       help=f"a model preset: {presets}; `mpk generate` runs smollm2-135m with "
                            "its real weights (downloaded once into MPK_CACHE_DIR), the others "
                            "with seeded random weights")
    if checkpoint:
        group.add_argument("--checkpoint", metavar="PATH",
                           help="a Hugging Face checkpoint folder (config.json + safetensors), "
                                "a .gguf file (llama, qwen3) or a folder holding one")


def _add_backend_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--backend", choices=("cpu", "cuda"), default=None,
                   help="where to run: the CPU interpreter or the CUDA megakernel "
                        "(default: cuda when a GPU is visible, else cpu)")


def _length_range(text: str) -> tuple[int, int]:
    try:
        lo, hi = (int(x) for x in text.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected LO:HI, e.g. 16:256, got {text!r}") from None
    if not 1 <= lo <= hi:
        raise argparse.ArgumentTypeError(f"need 1 <= LO <= HI, got {text!r}")
    return lo, hi


class _Parser(argparse.ArgumentParser):
    """argparse with the CLI's error format: one line `mpk: error: ...` and exit 2 (argparse's
    own prints the usage first; the hint names the --help that shows it)."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"mpk: error: {message} (see `{self.prog} --help`)\n")


def _add_verbose_arg(p: argparse.ArgumentParser, dest: str) -> None:
    p.add_argument("-v", "--verbose", action="count", default=0, dest=dest,
                   help="log progress (-vv: debug); show tracebacks on errors")


def build_parser() -> argparse.ArgumentParser:
    from mpk.models.config import PRESETS

    presets = ", ".join(PRESETS)
    parser = _Parser(
        prog="mpk", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="MPK compiles an LLM's decode step into one persistent CUDA megakernel; "
                    "a CPU interpreter runs the same compiled plan.",
        epilog=f"model presets: {presets}\n\nrun `mpk COMMAND --help` for a command's options.")
    _add_verbose_arg(parser, "verbose")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    def command(name: str, summary: str, examples: str,
                run: Callable[[argparse.Namespace], int]) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=summary, description=summary,
                           epilog="examples:\n" + examples,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        p.set_defaults(run=run)
        # -v also after the command; its own dest, since a subparser's defaults would overwrite
        # the count of a -v given before the command (main adds the two).
        _add_verbose_arg(p, "verbose_after")
        return p

    g = command("generate", "Generate tokens with a model (greedy, or sampled).", (
        "  mpk generate --model qwen3-0.6b --backend cpu --max-new-tokens 8\n"
        "  mpk generate --model smollm2-135m --prompt 'Once upon a time' --temperature 0.8 "
        "--top-p 0.95 --seed 1\n"
        "  mpk generate --model tiny-llama --prompt-ids 5,6,7 --prompt-ids 9 --json\n"
        "  mpk generate --model tiny-qwen3 --backend cpu --tp 2\n"
        "  mpk generate --checkpoint ~/models/Qwen3-0.6B --prompt 'The capital of France is'"),
        _cmd_generate)
    _add_model_args(g)
    prompt = g.add_mutually_exclusive_group()
    prompt.add_argument("--prompt", metavar="TEXT", action="append",
                        help="prompt text (needs a tokenizer: a checkpoint's tokenizer.json or "
                             "GGUF metadata); repeat for a batch")
    prompt.add_argument("--prompt-ids", metavar="IDS", type=_token_ids, action="append",
                        help="prompt token ids, e.g. 1,2,3; repeat for a batch "
                             f"(default: {','.join(map(str, DEFAULT_PROMPT_IDS))})")
    g.add_argument("--chat", action="store_true",
                   help="wrap each --prompt in the model's chat template as one user turn")
    g.add_argument("--max-new-tokens", type=int, default=8, metavar="N",
                   help="tokens to generate per prompt (default: 8)")
    _add_backend_arg(g)
    s = g.add_argument_group("sampling (default: greedy)")
    s.add_argument("--temperature", type=float, default=0.0, metavar="T",
                   help="sample from softmax(logits / T); 0 = greedy (default: 0)")
    s.add_argument("--top-k", type=int, default=0, metavar="K",
                   help="sample among the K most likely tokens only (default: 0, no limit)")
    s.add_argument("--top-p", type=float, default=1.0, metavar="P",
                   help="sample among the smallest set of tokens holding probability P "
                        "(default: 1, no limit)")
    s.add_argument("--seed", type=int, default=None, metavar="S",
                   help="sampling seed: the same seed gives the same tokens (default: random)")
    s.add_argument("--stop", metavar="TEXT", action="append", default=[],
                   help="stop a prompt's output before this text (needs a tokenizer); repeat "
                        "for several")
    g.add_argument("--weights-seed", type=int, default=0, metavar="S",
                   help="seed of a preset's random weights (default: 0)")
    g.add_argument("--ignore-eos", action="store_true", help="do not stop at the model's EOS ids")
    g.add_argument("--num-sms", type=_positive, default=None, metavar="N",
                   help="SMs (persistent CTAs) to compile for (default: every SM of the GPU, "
                        "or 4 on the CPU interpreter)")
    g.add_argument("--steps-per-launch", type=_positive, default=16, metavar="N",
                   help="decode steps per kernel launch (default: 16)")
    g.add_argument("--max-seq-len", type=_positive, default=None, metavar="N",
                   help="KV-cache length per sequence (default: what the request needs)")
    from mpk.server.options import add_prefill_arguments

    add_prefill_arguments(g)
    g.add_argument("--tp", type=_positive, default=1, metavar="G",
                   help="tensor-parallel ranks, one process (and one GPU) each (default: 1); "
                        "the CUDA all-reduce has not run on GPUs yet")
    g.add_argument("--json", action="store_true", help="print one JSON object, no progress bars")

    p = command("plan", "Compile a model's decode step and show the plan's statistics.", (
        "  mpk plan --model tiny-llama\n"
        "  mpk plan --model qwen3-8b --num-sms 132 --batch 4\n"
        "  mpk plan --model llama-3.2-1b --json"), _cmd_plan)
    _add_model_args(p)
    p.add_argument("--num-sms", type=_positive, default=PLAN_NUM_SMS, metavar="N",
                   help=f"SMs to schedule on (default: {PLAN_NUM_SMS}, an H100 / H200)")
    p.add_argument("--batch", type=_positive, default=1, metavar="B",
                   help="batch size (default: 1)")
    p.add_argument("--steps-per-launch", type=_positive, default=16, metavar="N",
                   help="decode steps per launch (default: 16)")
    p.add_argument("--max-seq-len", type=_positive, default=4096, metavar="N",
                   help="KV-cache length per sequence (default: 4096)")
    p.add_argument("--tp", type=_positive, default=1, metavar="G",
                   help="compile rank 0 of G tensor-parallel ranks (default: 1)")
    p.add_argument("--json", action="store_true", help="print the statistics as one JSON object")

    c = command("check", "Compare a backend's buffers with the reference, layer by layer.", (
        "  mpk check --model tiny-qwen3 --layers 0-1 --backend cpu\n"
        "  mpk check --model qwen3-0.6b --layers 0-3 --backend cuda --seed 1\n"
        "  mpk check --model qwen3-0.6b --batch 16 --backend cuda\n"
        "  mpk check --checkpoint ~/models/Qwen3-0.6B --layers 10-11 --backend cuda"), _cmd_check)
    _add_model_args(c)
    c.add_argument("--layers", type=_layer_range, default=None, metavar="A-B",
                   help="layers to build and compare, e.g. 0-1 (default: 0; for a MoE model "
                        "with dense layers, up to its first layer of the other kind)")
    _add_backend_arg(c)
    c.add_argument("--batch", type=_positive, default=1, metavar="B",
                   help="rows decoded together, each with its own prompt (default: 1)")
    c.add_argument("--seed", type=int, default=0, help="seed of the random weights (default: 0)")
    c.add_argument("--json", action="store_true", help="print the rows as one JSON object")
    b = command("bench", "Time MPK against torch.compile on the same weights (needs a GPU), or "
                         "the serving engine under a seeded request trace (--serving).", (
        "  mpk bench --model qwen3-0.6b\n"
        "  mpk bench --model llama-3.2-1b --batch 8 --new-tokens 100 --json\n"
        "  mpk bench --serving --model qwen3-8b --requests 64 --max-batch 16"), _cmd_bench)
    _add_model_args(b)
    b.add_argument("--batch", type=_positive, default=1, metavar="B",
                   help="sequences decoded together (default: 1)")
    b.add_argument("--new-tokens", type=_positive, default=200, metavar="N",
                   help="timed decode steps per repeat (default: 200)")
    b.add_argument("--seed", type=int, default=0, help="seed of the random weights (default: 0)")
    b.add_argument("--tp", type=_positive, default=1, metavar="G",
                   help="MPK on G GPUs, tensor parallel, one process each (default: 1; the "
                        "baseline stays on one GPU; not run on GPUs yet)")
    b.add_argument("--json", action="store_true", help="print the result as one JSON object")
    s = b.add_argument_group("serving mode (--serving)")
    s.add_argument("--serving", action="store_true",
                   help="replay a seeded trace of greedy requests through the serving engine: "
                        "each request alone, then all at their arrival times; throughput, TTFT, "
                        "inter-token latency, and whether every output equals its solo run")
    s.add_argument("--requests", type=_positive, default=32, metavar="N",
                   help="requests in the trace (default: 32)")
    s.add_argument("--rate", type=float, default=0.0, metavar="R",
                   help="Poisson arrivals per second (default: 0, all at once)")
    s.add_argument("--prompt-len", type=_length_range, default=(16, 256), metavar="LO:HI",
                   help="prompt lengths, log-uniform (default: 16:256)")
    s.add_argument("--output-len", type=_length_range, default=(16, 128), metavar="LO:HI",
                   help="output lengths, log-uniform (default: 16:128)")
    s.add_argument("--max-batch", type=_positive, default=16, metavar="B",
                   help="serving slots: one compiled plan of B rows (default: 16; also the "
                        "rows --prefill feeds a prompt with)")
    s.add_argument("--steps-per-launch", type=_positive, default=16, metavar="N",
                   help="decode steps per launch of the serving engine (default: 16; mpk "
                        "serve's default is 4)")
    s.add_argument("--prefill", type=_positive, default=None, metavar="P",
                   help="instead: time to first token of one P-token prompt (fed by the "
                        "prefill plan, or as a run of every row), against torch (cuBLAS + "
                        "SDPA) prefilling it in one call")
    from mpk.server.options import add_prefill_chunk_argument

    add_prefill_chunk_argument(s)
    _add_backend_arg(s)

    pr = command("profile", "Profile one launch on the GPU: a Perfetto trace (one track per SM), "
                            "an SM x time picture and a per-kind table.", (
        "  mpk profile --model qwen3-0.6b\n"
        "  mpk profile --model llama-3.2-1b --steps 16 --out prof/llama --json"), _cmd_profile)
    _add_model_args(pr)
    pr.add_argument("--steps", type=_positive, default=200, metavar="N",
                    help="decode steps per launch, profiled and timed (default: 200, as "
                         "`mpk bench --new-tokens`, so the two compare directly)")
    pr.add_argument("--batch", type=_positive, default=1, metavar="B",
                    help="sequences decoded together (default: 1)")
    pr.add_argument("--out", metavar="DIR", default=None,
                    help="folder for trace.json, sm_timeline.png, kinds.json "
                         "(default: mpk-profile/MODEL)")
    pr.add_argument("--seed", type=int, default=0, help="seed of the random weights (default: 0)")
    pr.add_argument("--json", action="store_true", help="print the summary as one JSON object")

    from mpk.server.options import add_serve_arguments

    sv = command("serve", "Serve a model over HTTP with OpenAI's API (completions, chat, "
                          "streaming), Prometheus metrics at /metrics.", (
        "  mpk serve --model smollm2-135m --backend cpu\n"
        "  mpk serve --backend cuda --model qwen3-8b --max-batch 16 --port 8000\n"
        "  mpk serve --checkpoint ~/models/Qwen3-0.6B --api-key SECRET --host 0.0.0.0"),
        _cmd_serve)
    _add_model_args(sv)
    _add_backend_arg(sv)
    add_serve_arguments(sv)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    args.verbose += getattr(args, "verbose_after", 0)
    logging.basicConfig(level=(logging.WARNING, logging.INFO, logging.DEBUG)[min(args.verbose, 2)],
                        format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    if args.command is None:
        parser.print_help(sys.stderr)
        return EXIT_USAGE
    try:
        return args.run(args)
    except (MpkError, FileNotFoundError, NotADirectoryError, PermissionError) as e:
        if args.verbose:
            raise
        lines = str(e).strip().splitlines() or [type(e).__name__]
        more = f" ({len(lines) - 1} more lines with -v)" if len(lines) > 1 else ""
        print(f"mpk: error: {lines[0]}{more}", file=sys.stderr)
        if cuda_context_lost():
            exit_now(EXIT_USAGE)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("mpk: interrupted", file=sys.stderr)
        return 130


def cuda_context_lost() -> bool:
    """Whether a fault inside a kernel (an illegal address, a trap) left this process's CUDA
    context unusable: every later CUDA call fails, including the caching allocator's when a CUDA
    tensor is freed at exit, which throws inside a C++ destructor and aborts the process (rc 134
    and a C++ stack after the one-line error)."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_initialized():
        return False
    try:
        torch.cuda.synchronize()
    except Exception:  # the sticky error again, whatever torch wraps it in
        return True
    return False


def exit_now(code: int) -> NoReturn:
    """End the process with `code` without running its destructors (see cuda_context_lost)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


# ---- mpk bench / mpk profile (cli_gpu.py) ----------------------------------------------------
def _cmd_bench(args: argparse.Namespace) -> int:
    from mpk.cli_gpu import bench

    if args.prefill is not None and args.serving:
        raise MpkError("give --serving or --prefill, not both")
    if not args.serving and args.backend == "cpu":
        raise MpkError("mpk bench times the CUDA megakernel; --backend cpu only with --serving")
    return bench(args, _backend(args) if args.serving else None)


def _cmd_profile(args: argparse.Namespace) -> int:
    from mpk.cli_gpu import profile

    return profile(args)


# ---- mpk serve (mpk.server) -------------------------------------------------------------------
def _cmd_serve(args: argparse.Namespace) -> int:
    try:
        from mpk.server.run import serve
    except ImportError as e:  # a --no-deps install, or one without the server extra
        raise MpkError(f"mpk serve needs the server extra ({e.name} is missing): "
                       f"pip install 'mpk[server]'") from None
    from mpk.server.options import options_from_args

    return serve(options_from_args(args, _backend(args)), args.verbose)


if __name__ == "__main__":
    sys.exit(main())
