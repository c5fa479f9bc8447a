#!/usr/bin/env bash
# Stops what up.sh started (node runner first, so its pods' processes go too; etcd last) and, with
# --purge, removes the state (etcd data, kubeconfig), so the next up.sh starts from an empty cluster.
set -uo pipefail
dir="${SLOFLEET_CLUSTER_DIR:-$HOME/.cache/slofleet/cluster}"
stop() {
  local pidfile="$dir/$1.pid"
  [[ -f "$pidfile" ]] || return 0
  local pid; pid="$(cat "$pidfile")"
  if kill -0 "$pid" 2>/dev/null; then
    kill -TERM -- "-$pid" 2>/dev/null || kill -TERM "$pid"
    for _ in $(seq 1 60); do kill -0 "$pid" 2>/dev/null || break; sleep 0.25; done
    kill -KILL -- "-$pid" 2>/dev/null || true
  fi
  rm -f "$pidfile"
}
stop noderunner
# Pod processes run in sessions of their own; the runner stops them, and this catches any it left behind.
for f in "$dir"/pods/*/*.pid; do
  [[ -f "$f" ]] || continue
  kill -KILL -- "-$(cat "$f")" 2>/dev/null || true
  rm -f "$f"
done
for name in kube-controller-manager kube-apiserver etcd; do stop "$name"; done
if [[ "${1:-}" == "--purge" ]]; then rm -rf "$dir"; fi
echo "cluster: stopped" >&2
