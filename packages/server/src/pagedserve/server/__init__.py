"""pagedserve.server: the OpenAI-compatible HTTP server (Starlette + uvicorn) and the CLI."""
