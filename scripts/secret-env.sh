#!/bin/sh
# secret-env.sh COMMAND [ARG...]: run COMMAND with the Prefect credential read from a file.
#
# For NAME in PREFECT_SERVER_API_AUTH_STRING (the server's basic-auth "user:password") and
# PREFECT_API_AUTH_STRING (what a client presents): when NAME_FILE names a file, NAME is set to its
# contents (trailing newlines dropped) and NAME_FILE is unset, then COMMAND replaces this shell.
# A compose secret is such a file (/run/secrets/NAME), so the credential is never written in
# docker/compose.yaml, nor shown by `docker inspect` or `docker compose config`. Prefect reads
# NAME from the environment only (no *_FILE form of its own), hence this step. Never prints a value.
set -eu

load() {
    name=$1
    eval "file=\${${name}_FILE:-}"
    [ -n "$file" ] || return 0
    if [ ! -r "$file" ] || [ ! -s "$file" ]; then
        echo "secret-env.sh: ${name}_FILE=$file is missing, unreadable or empty (docs/prefect.md#credentials)" >&2
        exit 1
    fi
    value=$(cat "$file")
    export "$name=$value"
    unset "${name}_FILE"
}

load PREFECT_SERVER_API_AUTH_STRING
load PREFECT_API_AUTH_STRING
exec "$@"
