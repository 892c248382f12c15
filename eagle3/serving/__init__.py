"""Serving the target model: a vLLM server this process manages (start, watch, stop)."""

from eagle3.serving.managed import ManagedServer, ServerError, free_port

__all__ = ["ManagedServer", "ServerError", "free_port"]
