#!/bin/sh
# secret-env.sh COMMAND [ARG...]: run COMMAND with its credentials read from files.
#
# For NAME in PREFECT_SERVER_API_AUTH_STRING (the Prefect server's basic-auth "user:password"),
# PREFECT_API_AUTH_STRING (what a Prefect client presents), VLLM_API_KEY (the key a vLLM server
# requires), EAGLE3_API_KEY (the key the pipeline presents to it, server.api_key_env's default) and
# PREFECT_SERVER_DATABASE_PASSWORD (the Prefect server's database password):
# when NAME_FILE names a file, NAME is set to its contents (trailing newlines dropped) and NAME_FILE
# is unset, then COMMAND replaces this shell. A compose secret is such a file (/run/secrets/NAME), so
# the credential is never written in docker/compose.yaml, nor shown by `docker inspect` or
# `docker compose config`, nor on a command line (`ps` shows those to every user). Prefect and vLLM
# read NAME from the environment only (no *_FILE form of their own), hence this step. Never prints a
# value.
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
load VLLM_API_KEY
load EAGLE3_API_KEY
load PREFECT_SERVER_DATABASE_PASSWORD
exec "$@"
