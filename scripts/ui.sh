#!/usr/bin/env bash
# `make ui`: a Prefect server with the UI, the project's deployments registered, and a worker.
#
#   EAGLE3_UI_HOST (default 127.0.0.1: loopback only; set 0.0.0.0 deliberately to expose it)
#   EAGLE3_UI_PORT (default 4200)
#   PREFECT_API_DATABASE_CONNECTION_URL  unset: SQLite under $PREFECT_HOME (.prefect/);
#       postgresql+asyncpg://USER:PASS@HOST:5432/DB for a Postgres-backed server (several workers).
# Logs and pids go to .prefect/ui/; `make ui-stop` stops the server and the worker.
set -euo pipefail
cd "$(dirname "$0")/.."
HOST="${EAGLE3_UI_HOST:-127.0.0.1}"
PORT="${EAGLE3_UI_PORT:-4200}"
PREFECT=".venv/bin/prefect"
STATE=".prefect/ui"
mkdir -p "$STATE"

if [ "${1:-}" = "stop" ]; then
  # A Prefect worker ignores its first SIGTERM: signal twice, then SIGKILL whatever is left.
  for name in worker server; do
    pidfile="$STATE/$name.pid"
    [ -f "$pidfile" ] || continue
    pid="$(cat "$pidfile")"
    for sig in TERM TERM KILL; do
      kill -0 "$pid" 2>/dev/null || break
      kill "-$sig" "$pid" 2>/dev/null
      for _ in $(seq 1 10); do kill -0 "$pid" 2>/dev/null || break; sleep 0.5; done
    done
    rm -f "$pidfile"
    echo "stopped the $name"
  done
  exit 0
fi
export PREFECT_API_URL="http://${HOST}:${PORT}/api"
export PREFECT_UI_API_URL="$PREFECT_API_URL"   # else the page calls 127.0.0.1:4200 and shows no runs
export EAGLE3_PROJECT_DIR="$PWD"
# The Prefect client's retry window for the worker and the flow runs it starts, as the eagle3 command sets it
# (cli/prefect_client.py says why; docs/faults.md#orchestrator-loss); the environment may set other values.
export PREFECT_CLIENT_MAX_RETRIES="${PREFECT_CLIENT_MAX_RETRIES:-6}"
export PREFECT_CLIENT_RETRY_JITTER_FACTOR="${PREFECT_CLIENT_RETRY_JITTER_FACTOR:-0.2}"
export PREFECT_CLIENT_RETRY_EXTRA_CODES="${PREFECT_CLIENT_RETRY_EXTRA_CODES:-500}"
export PREFECT_API_REQUEST_TIMEOUT="${PREFECT_API_REQUEST_TIMEOUT:-60}"

if curl -fsS --max-time 3 "$PREFECT_API_URL/health" >/dev/null 2>&1; then
  echo "== a Prefect server already answers on $PREFECT_API_URL; using it"
else
  echo "== starting the Prefect server on $HOST:$PORT (log: $STATE/server.log)"
  nohup "$PREFECT" server start --host "$HOST" --port "$PORT" >"$STATE/server.log" 2>&1 &
  echo $! >"$STATE/server.pid"
  for _ in $(seq 1 120); do
    curl -fsS --max-time 3 "$PREFECT_API_URL/health" >/dev/null 2>&1 && break
    sleep 1
  done
  curl -fsS --max-time 3 "$PREFECT_API_URL/health" >/dev/null || { echo "the Prefect server did not come up in 120 s; see $STATE/server.log" >&2; exit 1; }
fi

"$PREFECT" work-pool create eagle3-process --type process --overwrite >/dev/null
echo "== registering deployments from deployments/prefect.yaml"
"$PREFECT" --no-prompt deploy --all --prefect-file deployments/prefect.yaml

if [ -f "$STATE/worker.pid" ] && kill -0 "$(cat "$STATE/worker.pid")" 2>/dev/null; then
  echo "== a worker is already running (pid $(cat "$STATE/worker.pid"))"
else
  echo "== starting a worker on pool eagle3-process (log: $STATE/worker.log)"
  nohup "$PREFECT" worker start --pool eagle3-process >"$STATE/worker.log" 2>&1 &
  echo $! >"$STATE/worker.pid"
fi
echo
echo "Prefect UI: http://${HOST}:${PORT}"
echo "  deployments: eagle3-regenerate/nightly-regeneration (02:00 Europe/Berlin), eagle3-pipeline/full-pipeline (on demand)"
echo "  stop with: make ui-stop"
