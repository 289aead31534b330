"""What `mpk serve` serves and how: its command-line arguments and ServeOptions.

Imports nothing heavy, so the CLI can build its parser without FastAPI installed.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from mpk import env

DEFAULT_HOST = "127.0.0.1"  # loopback: exposing a server is a decision the user makes (--host)
DEFAULT_PORT = 8000
DEFAULT_MAX_BATCH = 8
# Tokens of one launch reach the clients together and a new request joins only at a launch
# boundary, so serving wants short launches: 4 steps keep streaming smooth and admission quick,
# while the host work per launch (inputs, outputs) stays small against 4 decode steps.
DEFAULT_STEPS_PER_LAUNCH = 4


@dataclass(frozen=True)
class ServeOptions:
    """Everything `mpk serve` needs to start (one of preset / checkpoint is set)."""

    preset: str | None = None
    checkpoint: str | None = None
    backend: str = "cpu"
    host: str = DEFAULT_HOST
    port: int = DEFAULT_PORT
    max_batch: int = DEFAULT_MAX_BATCH
    max_seq_len: int | None = None  # None: the engine's default (2048 or the model's limit)
    steps_per_launch: int = DEFAULT_STEPS_PER_LAUNCH
    prefill_rows: int | None = None  # None: the engine's default (the most rows a plan has)
    prefill_chunk: int = 256  # prompt positions per prefill-plan launch (0: none)
    num_sms: int | None = None
    api_key: str | None = None
    served_model_name: str | None = None
    weights_seed: int = 0  # random weights of a preset without real ones


def positive(text: str) -> int:
    """argparse type: an integer > 0."""
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text}")
    return value


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    """The serve-specific options (the CLI adds --model / --checkpoint / --backend / -v)."""

    def port(text: str) -> int:
        value = int(text)
        if not 0 <= value <= 65535:
            raise argparse.ArgumentTypeError(f"a port is 0-65535 (0: any free one), got {text}")
        return value

    p.add_argument("--host", default=DEFAULT_HOST,
                   help=f"address to listen on (default: {DEFAULT_HOST}; 0.0.0.0 for every "
                        f"interface)")
    p.add_argument("--port", type=port, default=DEFAULT_PORT,
                   help=f"TCP port (default: {DEFAULT_PORT}; 0 picks a free one and prints it)")
    p.add_argument("--max-batch", type=positive, default=DEFAULT_MAX_BATCH, metavar="B",
                   help=f"requests decoded at once, 1-16 (default: {DEFAULT_MAX_BATCH}); more "
                        f"wait in a first-come-first-served queue")
    p.add_argument("--max-seq-len", type=positive, default=None, metavar="N",
                   help="context per request, prompt plus output tokens (default: 2048 or the "
                        "model's limit)")
    p.add_argument("--steps-per-launch", type=positive, default=DEFAULT_STEPS_PER_LAUNCH,
                   metavar="N",
                   help=f"decode steps per kernel launch (default: {DEFAULT_STEPS_PER_LAUNCH}); "
                        f"a launch's tokens reach clients together")
    add_prefill_arguments(p)
    p.add_argument("--num-sms", type=positive, default=None, metavar="N",
                   help="SMs (persistent CTAs) to compile for (default: every SM of the GPU, "
                        "or 4 on the CPU interpreter)")
    p.add_argument("--api-key", default=None, metavar="KEY",
                   help="require `Authorization: Bearer KEY` on /v1 requests (401 otherwise); "
                        "/health and /metrics stay open (default: $MPK_API_KEY, else none)")
    p.add_argument("--served-model-name", default=None, metavar="NAME",
                   help="the model id clients send (default: the preset name, else the "
                        "checkpoint's name)")
    p.add_argument("--weights-seed", type=int, default=0, metavar="S",
                   help="seed of the random weights of presets without real ones (default: 0); "
                        "requests carry their own sampling seed")


def add_prefill_arguments(p: argparse.ArgumentParser) -> None:
    """How prompts are fed (the engine's prefill_rows and prefill_chunk): mpk serve and
    mpk generate take the same two options."""
    p.add_argument("--prefill-rows", type=positive, default=None, metavar="R",
                   help="rows of the plan that feeds long prompts many positions a step "
                        "(chunked prefill in the decode batch), 1-16 (default: 16, the most a "
                        "plan has); with more rows than the batch it is a second plan on the "
                        "same KV cache, built for prompts longer than a launch; 1: one position "
                        "a step")
    add_prefill_chunk_argument(p)


def add_prefill_chunk_argument(p: argparse.ArgumentParser) -> None:
    """--prefill-chunk (mpk bench takes it alone: its --max-batch sets the rows)."""
    p.add_argument("--prefill-chunk", type=int, default=256, metavar="C",
                   help="prompt positions per launch of the prefill plan, where the backend "
                        "runs one (the CPU interpreter; CUDA for dense models with head dims "
                        "up to 128; default: 256; a multiple of 64 spreads attention over "
                        "64-row tasks, any other size gives it one task per KV head); 0: none, "
                        "prompts go in as runs of the decode batch")


def options_from_args(args: argparse.Namespace, backend: str) -> ServeOptions:
    return ServeOptions(preset=None if args.checkpoint else args.model,
                        checkpoint=args.checkpoint, backend=backend, host=args.host,
                        port=args.port, max_batch=args.max_batch, max_seq_len=args.max_seq_len,
                        steps_per_launch=args.steps_per_launch,
                        prefill_rows=args.prefill_rows, prefill_chunk=args.prefill_chunk,
                        num_sms=args.num_sms,
                        api_key=args.api_key or env.api_key(),
                        served_model_name=args.served_model_name,
                        weights_seed=args.weights_seed)
