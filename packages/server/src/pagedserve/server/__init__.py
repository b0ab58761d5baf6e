"""pagedserve.server: the command line and (soon) the OpenAI-compatible HTTP server."""
