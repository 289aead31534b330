"""`mpk serve`: load the model, start the engine, serve HTTP with uvicorn until SIGTERM / SIGINT.

A signal drains: /v1 requests get 503 (the listening socket stays open, so clients get an
answer rather than a refused connection), running and queued requests finish, their responses
are sent, then uvicorn shuts down and the process exits 0. A second signal cancels what still
runs and exits at once (1).
"""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
import sys
from types import FrameType

import uvicorn

from mpk.backends.registry import get_backend
from mpk.engine import Engine
from mpk.engine.job import ModelSource
from mpk.models.resolve import resolve_model
from mpk.server.app import RequestIdFilter, create_app
from mpk.server.options import ServeOptions
from mpk.server.state import ServerState
from mpk.server.text import TextCodec

log = logging.getLogger("mpk.server")
DRAIN_SEND_TIMEOUT_S = 60  # after the engine drained: for the last bytes to reach the clients
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s [%(request_id)s] %(message)s"


def serve(opts: ServeOptions, verbose: int = 0) -> int:
    """Run the server until it is told to stop; the process's exit status."""
    _configure_logging(verbose)
    state = build_state(opts)
    app = create_app(state)
    sock = _listen(opts.host, opts.port)
    host, port = sock.getsockname()[:2]
    config = uvicorn.Config(app, log_config=None, access_log=False, lifespan="off",
                            timeout_graceful_shutdown=30)
    server = _DrainingServer(config, state)
    url_host = f"[{host}]" if ":" in host else host
    # The one line on stdout: scripts and tests read the address from it (--port 0).
    print(f"mpk serve: {state.model_name} on http://{url_host}:{port}/v1 (backend "
          f"{opts.backend}, max batch {opts.max_batch}, context {state.max_seq_len})", flush=True)
    try:
        server.run(sockets=[sock])
    finally:
        state.engine.stop(drain=False, timeout=10)  # after a forced exit; no-op after a drain
    return 1 if server.forced else 0


def build_state(opts: ServeOptions) -> ServerState:
    """The model loaded and its engine serving (compiles the plan: the slow part)."""
    resolved = resolve_model(opts.preset, opts.checkpoint, progress=False)
    cfg = resolved.cfg
    if resolved.random_weights:
        log.warning("preset %r runs with random weights (seed %d): its output carries no "
                    "meaning", resolved.label, opts.weights_seed)
    device = get_backend(opts.backend).device_type
    weights = ModelSource(cfg, resolved.checkpoint, opts.weights_seed).load(device)
    engine = Engine(cfg, weights, backend=opts.backend, num_sms=opts.num_sms,
                    max_seq_len=opts.max_seq_len, steps_per_launch=opts.steps_per_launch,
                    prefill_rows=opts.prefill_rows, prefill_chunk=opts.prefill_chunk,
                    progress=False)
    name = opts.served_model_name or resolved.label
    codec = TextCodec(resolved.tokenizer, resolved.chat_template, name)
    log.info("compiling the decode plan for batch %d", opts.max_batch)
    engine.start(max_batch=opts.max_batch, detokenize=codec.detokenize)
    return ServerState(engine=engine, codec=codec, model_name=name,
                       max_seq_len=engine.max_seq_len, max_batch=opts.max_batch,
                       eos_token_ids=tuple(cfg.eos_token_ids), api_key=opts.api_key)


class _DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, state: ServerState) -> None:
        super().__init__(config)
        self.state = state
        self.forced = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain_task: asyncio.Task[None] | None = None  # referenced: tasks are weakly held

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().startup(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # Not uvicorn's: it records the signal and raises it again after shutdown, so the
        # process would die of SIGTERM instead of exiting 0 after a completed drain.
        if self._loop is None:  # before the loop runs: nothing to drain
            self.should_exit = True
        elif not self.state.draining:
            self._loop.call_soon_threadsafe(self._start_drain, sig)
        else:
            self._loop.call_soon_threadsafe(self._force)

    def _start_drain(self, sig: int) -> None:
        if self._drain_task is None:
            self._drain_task = asyncio.ensure_future(self._drain(sig))

    async def _drain(self, sig: int) -> None:
        state = self.state
        state.draining = True
        load = state.load()
        log.info("%s: draining (%d running, %d waiting); new requests get 503",
                 signal.Signals(sig).name, load.running, load.waiting)
        # Off the loop: it blocks until the engine's last request has finished.
        await asyncio.to_thread(state.engine.stop, True)
        try:  # every response sent to the end (a client that stopped reading: not forever)
            await asyncio.wait_for(state.idle.wait(), DRAIN_SEND_TIMEOUT_S)
        except asyncio.TimeoutError:
            log.warning("responses still unsent after %d s; shutting down anyway",
                        DRAIN_SEND_TIMEOUT_S)
        if not self.forced:
            log.info("drained; shutting down")
        self.should_exit = True

    def _force(self) -> None:
        log.warning("second signal: cancelling running requests and exiting")
        self.forced = True
        sched = self.state.engine.scheduler
        if sched is not None:
            sched.cancel_all()
        self.should_exit = self.force_exit = True


def _listen(host: str, port: int) -> socket.socket:
    """A listening socket on host:port (port 0: a free one), bound before uvicorn starts so the
    address can be printed, and reported clearly when taken."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        return socket.create_server((host, port), family=family, backlog=2048)
    except OSError as e:
        from mpk.errors import MpkError

        raise MpkError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None


def _configure_logging(verbose: int) -> None:
    """Request lines (INFO) always; uvicorn's own chatter with -v. Every line names the request
    it belongs to."""
    root = logging.getLogger()
    if not root.handlers:
        root.addHandler(logging.StreamHandler(sys.stderr))
    for handler in root.handlers:
        handler.addFilter(RequestIdFilter())
        handler.setFormatter(logging.Formatter(LOG_FORMAT))
    logging.getLogger("mpk.server").setLevel(logging.DEBUG if verbose > 1 else logging.INFO)
    logging.getLogger("uvicorn").setLevel(logging.INFO if verbose else logging.WARNING)
