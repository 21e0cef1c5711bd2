"""The OpenAI-compatible REST gateway: ``dspark-router serve``, a thin HTTP layer over :class:`router.sdk.Router`.

Modules, one job each: ``settings`` (the ``gateway:`` config section; no web framework imported, since the router's
config loads it), ``app`` (the endpoints), ``shapes`` (routed results as OpenAI bodies and stream chunks),
``errors`` (every failure as OpenAI's error body), ``limits`` (keys and their rates, the body cap, concurrency),
``disconnect`` (stopping the work of a client that went away), ``headers`` (the request id and decision headers),
``readiness`` (warm-up in the background), ``metrics`` (the gateway's own counters), ``docs`` (the OpenAPI request
schemas, derived from the SDK's parsing) and ``serve`` (the console command on uvicorn).
"""
