"""`mpk serve`: an OpenAI-compatible HTTP server on the serving engine (mpk.engine).

Layout (each file small; only run.py and app.py import FastAPI / uvicorn, so `mpk --help` and the
other commands work without the `server` extra installed):

  options.py   the command's arguments and ServeOptions (what to serve, where)
  protocol.py  OpenAI request bodies (pydantic) and their mapping to SamplingParams
  text.py      prompt encoding and streamed text: UTF-8-safe, never emits a stop string's start
  errors.py    OpenAI's error schema, statuses, and the handlers that produce it
  metrics.py   Prometheus metrics: load, pages, TTFT / inter-token histograms, tokens/s
  tokens.py    a RequestHandle's tokens as an async iterator; cancel on client disconnect
  routes.py    /v1/completions, /v1/chat/completions, /v1/models, /health, /metrics
  app.py       the FastAPI app: request ids, logging, API key, drain refusal, no tracebacks out
  run.py       load the model, start the engine, run uvicorn; SIGTERM drains then exits 0
"""
