"""The environment a child process gets: this process's, less the credentials it has no use for.

The pipeline's own process may hold credentials (the Prefect server's, a vLLM server's key, a Hugging
Face token) that it got from its environment. A child inherits the whole environment by default, where
anyone who can read the child's (``/proc/PID/environ``, a crash report, an environment dump in a
debugging session, a core file) reads them too, for as long as the child runs: a vLLM server runs
for a whole stage. So every child the pipeline starts (a vLLM server, the vLLM extraction worker,
torchrun, the guard of a child group, the temporary Prefect server) gets ``child_env()``: what it
needs and nothing of another service's.

Names, not a pattern: a variable some child does read (Ray's own token, a cloud library's) is never
dropped by a guess. The list is the credentials the pipeline itself knows of; ``drop`` adds a
config's own key variable (server.api_key_env).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping

# Why no child needs each one:
# - Prefect: the flow process talks to Prefect, its children never do; the client's credential,
#   Prefect Cloud's key, and a server's credential and database (a connection URL holds its password).
#   The temporary Prefect server is a Prefect server and keeps the server's settings (``keep``).
# - Hugging Face: models reach children as local folders the pipeline process resolved
#   (eagle3/models.py; the extraction worker even runs with HF_HUB_OFFLINE=1), so no child asks the hub.
# - vLLM keys: a managed server gets its own as VLLM_API_KEY, set after this scrub; the key of the
#   external servers (server.api_key_env, default EAGLE3_API_KEY), the managed server's as the shard
#   tasks read it (EAGLE3_MANAGED_SERVER_KEY, eagle3/serving/target.py) and OpenAI's are no child's.
PREFECT_SERVER_SECRETS = frozenset(
    {
        "PREFECT_SERVER_API_AUTH_STRING",
        "PREFECT_API_DATABASE_PASSWORD",
        "PREFECT_SERVER_DATABASE_PASSWORD",
        "PREFECT_API_DATABASE_CONNECTION_URL",
        "PREFECT_SERVER_DATABASE_CONNECTION_URL",
    }
)
SECRET_ENV = PREFECT_SERVER_SECRETS | {
    "PREFECT_API_AUTH_STRING",
    "PREFECT_API_KEY",
    "HF_TOKEN",
    "HUGGING_FACE_HUB_TOKEN",
    "OPENAI_API_KEY",
    "VLLM_API_KEY",
    "EAGLE3_API_KEY",
    "EAGLE3_MANAGED_SERVER_KEY",
}


def child_env(
    base: Mapping[str, str] | None = None, *, drop: Iterable[str] = (), keep: Iterable[str] = ()
) -> dict[str, str]:
    """``base`` (default: this process's environment) without the names in ``SECRET_ENV`` and
    ``drop``, except those in ``keep``."""
    hidden = (SECRET_ENV | set(drop)) - set(keep)
    return {k: v for k, v in (os.environ if base is None else base).items() if k not in hidden}
