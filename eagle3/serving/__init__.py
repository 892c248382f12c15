"""Serving the target model: a vLLM server this process manages (start, watch, stop), and the client
that sends it requests (client.py: deadlines, retries, replicas), which generate and prepare share."""

from eagle3.serving.managed import ManagedServer, ServerError, free_port

__all__ = ["ManagedServer", "ServerError", "free_port"]
