"""External mode: servers someone else runs, checked before any request is sent."""

from __future__ import annotations

import asyncio

import httpx


def root_of(base_url: str) -> str:
    """``http://h:8000/v1`` -> ``http://h:8000`` (vLLM serves /health at the root)."""
    return base_url.rstrip("/").removesuffix("/v1")


async def _probe(client: httpx.AsyncClient, base_url: str, api_key: str | None) -> str | None:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        health = await client.get(f"{root_of(base_url)}/health")
        if health.status_code != 200:
            return f"/health answered {health.status_code}"
        models = await client.get(f"{base_url.rstrip('/')}/models", headers=headers)
        if models.status_code != 200:
            return f"/v1/models answered {models.status_code}: {models.text[:200]}"
    except httpx.HTTPError as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


async def check_replicas(
    base_urls: list[str], api_key: str | None, timeout_s: float = 10.0
) -> tuple[list[str], dict[str, str]]:
    """Probe every replica at once: (healthy URLs, {unhealthy URL: why})."""
    timeout = httpx.Timeout(timeout_s, connect=min(5.0, timeout_s))
    async with httpx.AsyncClient(timeout=timeout) as client:
        problems = await asyncio.gather(*(_probe(client, url, api_key) for url in base_urls))
    healthy = [u for u, p in zip(base_urls, problems) if p is None]
    return healthy, {u: p for u, p in zip(base_urls, problems) if p is not None}
