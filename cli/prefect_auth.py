"""The Prefect server's credential, as the ``eagle3`` command presents it.

A Prefect server started with ``PREFECT_SERVER_API_AUTH_STRING`` (basic auth, "user:password";
docker/compose.yaml's does) answers 401 to every API call without it. Prefect's client presents
``PREFECT_API_AUTH_STRING`` (the environment or the active profile); the command also takes
``PREFECT_API_AUTH_STRING_FILE``, the path of a file holding it (a compose or Kubernetes secret
mounted as a file, or docker/secrets/prefect-auth-string on the compose host), read before Prefect
is imported. Then, with ``PREFECT_API_URL`` set, one request checks that the server takes what is
presented, so a missing or wrong credential is one line naming the variable, not a traceback from
the first flow run; so is a URL where no Prefect API answers (nothing listening, a wrong host, port,
scheme or path), which is not a server lost mid-run (cli/prefect_client.py): nothing has started.
The value is never printed, logged nor written anywhere.
"""

from __future__ import annotations

import os
from pathlib import Path

from eagle3.errors import UserError

AUTH_ENV = "PREFECT_API_AUTH_STRING"
AUTH_FILE_ENV = "PREFECT_API_AUTH_STRING_FILE"
HOWTO = "docs/prefect.md#credentials"
# Each attempt of the check: the API answers /api/hello in milliseconds, so 10 s means nobody will.
# Prefect's client still retries a timed-out attempt within its window (cli/prefect_client.py), as it
# would any call of the run; a refused first connection is not retried and fails at once.
CHECK_TIMEOUT_S = 10.0
UNSET_HINT = "unset, the command runs a temporary Prefect server of its own"


class PrefectAuthError(UserError):
    """The Prefect server at PREFECT_API_URL refused this process, or the credential's file is unusable."""


class PrefectUnreachable(UserError):
    """No Prefect API answers at PREFECT_API_URL: nothing listens there, or what does is not Prefect's API."""


def load_auth_file() -> None:
    """``PREFECT_API_AUTH_STRING`` from the file ``PREFECT_API_AUTH_STRING_FILE`` names, when it is set.
    Call before Prefect is imported: Prefect reads its settings from the environment once."""
    path = os.environ.get(AUTH_FILE_ENV)
    if not path:
        return
    try:
        value = Path(path).read_text().strip("\r\n")
    except OSError as exc:
        raise PrefectAuthError(f"{AUTH_FILE_ENV}={path}: cannot read it ({exc.strerror}); see {HOWTO}") from None
    if not value:
        raise PrefectAuthError(f"{AUTH_FILE_ENV}={path}: the file is empty; it holds the server's 'user:password'")
    os.environ[AUTH_ENV] = value


def check_api() -> None:
    """With PREFECT_API_URL set, one authenticated request (``/api/hello``) to the server: a 401, no
    answer, or an answer that is not Prefect's fails here in one line naming the URL and what to do.
    Without a URL the command runs a temporary local server (no credential)."""
    import httpx
    from prefect.client.orchestration import get_client
    from prefect.exceptions import PrefectHTTPStatusError
    from prefect.settings import get_current_settings

    settings = get_current_settings().api
    if not settings.url:
        return
    try:
        with get_client(sync_client=True, httpx_settings={"timeout": httpx.Timeout(CHECK_TIMEOUT_S)}) as client:
            client.hello()
    except PrefectHTTPStatusError as exc:
        if exc.response.status_code != 401:
            raise _answered(settings.url, exc.response) from None
        _refused(settings)
    except (httpx.HTTPError, httpx.InvalidURL) as exc:
        why = (str(exc).splitlines() or [""])[0] or "no detail"
        raise PrefectUnreachable(
            f"no Prefect server answered at PREFECT_API_URL={settings.url} ({type(exc).__name__}: {why}): start it, "
            f"or fix PREFECT_API_URL (http://HOST:PORT/api; {UNSET_HINT})"
        ) from None


def _answered(url: str, response) -> PrefectUnreachable:
    """The error for an answer other than 200 or 401 to /api/hello."""
    status = f"{response.status_code} {response.reason_phrase}".strip()
    if response.status_code >= 500:
        what = "the Prefect server there failed (its log says why; a restarting server answers again shortly)"
    else:
        what = "no Prefect API is there: check the host, the port and the path, which ends in /api"
    return PrefectUnreachable(
        f"PREFECT_API_URL={url} answered {status} to GET {response.request.url}: {what} ({UNSET_HINT})"
    )


def _refused(settings) -> None:
    """The error for a 401: no credential presented, or the wrong one."""
    if settings.auth_string is None and settings.key is None:
        raise PrefectAuthError(
            f"the Prefect server at PREFECT_API_URL={settings.url} requires a credential: set {AUTH_ENV} "
            f"('user:password') or {AUTH_FILE_ENV} (a file holding it); see {HOWTO}"
        ) from None
    raise PrefectAuthError(
        f"the Prefect server at PREFECT_API_URL={settings.url} refused the credential presented "
        f"({AUTH_FILE_ENV if os.environ.get(AUTH_FILE_ENV) else AUTH_ENV}, or PREFECT_API_KEY, which Prefect "
        f"presents instead when both are set): it is not the server's PREFECT_SERVER_API_AUTH_STRING; see {HOWTO}"
    ) from None
