#!/usr/bin/env bash
# A local Flower deployment on loopback: flower-superlink + 2 nodes (each a torchrun group of 2
# ranks and a flower-supernode), then `flwr run`. Everything is stopped on exit, also on error
# or Ctrl-C. Extra arguments go to --run-config, e.g.:
#   examples/local_deployment.sh "num-server-rounds=5 transport='collective'"
set -euo pipefail
cd "$(dirname "$0")/.."
VENV_BIN="$(pwd)/.venv/bin"
export PATH="$VENV_BIN:$PATH"
WORK="$(mktemp -d -t flower-shard-local-XXXXXX)"
export FLWR_HOME="$WORK/flwr-home"
export FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION=1
mkdir -p "$FLWR_HOME" runs/local
cp examples/config.toml "$FLWR_HOME/config.toml"
# Everything started from here inherits this marker, even what Flower detaches (SuperExec,
# ServerApp): cleanup finds those processes by it.
export FLOWER_SHARD_TREE="local-$$-$RANDOM"
PIDS=()
cleanup() {
  for pid in "${PIDS[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done
  for pid in "${PIDS[@]}"; do wait "$pid" 2>/dev/null || true; done
  for p in /proc/[0-9]*; do
    pid=${p#/proc/}
    [ "$pid" = "$$" ] && continue
    if tr '\0' '\n' < "$p/environ" 2>/dev/null | grep -qx "FLOWER_SHARD_TREE=$FLOWER_SHARD_TREE"; then
      kill -KILL "$pid" 2>/dev/null || true
    fi
  done
  rm -rf "$WORK"
}
trap cleanup EXIT INT TERM
# wait_for SECONDS WHAT CMD...: poll CMD until it succeeds; give up with a message after SECONDS.
wait_for() {
  local limit=$1 what=$2 start=$SECONDS
  shift 2
  until "$@"; do
    if ((SECONDS - start > limit)); then
      echo "local_deployment: $what not ready after ${limit} s; logs in $WORK" >&2
      tail -n 20 "$WORK"/*.log >&2 || true
      exit 1
    fi
    sleep 0.5
  done
}

flower-superlink --insecure --disable-runtime-dependency-installation --port 8000 \
  > "$WORK/superlink.log" 2>&1 &
PIDS+=($!)
wait_for 60 "the SuperLink" curl -sf -o /dev/null http://127.0.0.1:8000/health

for i in 0 1; do
  flower-shard node --superlink 127.0.0.1:8000 --nproc-per-group 2 --work-dir "$WORK/node$i" \
    > "$WORK/node$i.log" 2>&1 &
  PIDS+=($!)
done
for i in 0 1; do
  wait_for 300 "node $i" grep -q "flower-shard node: group" "$WORK/node$i.log"
done

# The ServerApp writes summary.json when the run ends: never read one from an earlier run.
rm -f runs/local/summary.json
flwr run . local-deployment --run-config "out-dir='$(pwd)/runs/local' min-groups=2 ${1:-}"
wait_for 3600 "the run's summary" test -f runs/local/summary.json
cat runs/local/summary.json
