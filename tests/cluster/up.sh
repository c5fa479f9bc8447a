#!/usr/bin/env bash
# Starts a local Kubernetes control plane on loopback for tests and trying slofleet out:
# etcd, kube-apiserver, kube-controller-manager (built by build.sh) and the test-only node runner
# (noderunner.py: a simulated node that runs each pod's container command as a local process).
# Writes $SLOFLEET_CLUSTER_DIR/kubeconfig; stop everything with down.sh. Idempotent: a running plane is reused.
#
# Env: SLOFLEET_CLUSTER_DIR (state, default ~/.cache/slofleet/cluster), SLOFLEET_APISERVER_PORT (16443),
#      SLOFLEET_ETCD_PORT (23790), SLOFLEET_NODE_PATH (PATH the node runner resolves commands in),
#      SLOFLEET_NODE_RUNNER=0 to start no node runner, PYTHON (default .venv/bin/python).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
dir="${SLOFLEET_CLUSTER_DIR:-$HOME/.cache/slofleet/cluster}"
api_port="${SLOFLEET_APISERVER_PORT:-16443}"
etcd_port="${SLOFLEET_ETCD_PORT:-23790}"
python="${PYTHON:-$repo/.venv/bin/python}"
kubeconfig="$dir/kubeconfig"
t0=$(date +%s)
phase() { echo "cluster: $1 ($(( $(date +%s) - t0 ))s)" >&2; }

alive() { [[ -f "$dir/$1.pid" ]] && kill -0 "$(cat "$dir/$1.pid")" 2>/dev/null; }
start() {  # name, command...: runs in its own session, so down.sh can stop its whole process group
  local name=$1; shift
  if alive "$name"; then return; fi
  setsid "$@" >"$dir/$name.log" 2>&1 < /dev/null &
  echo $! >"$dir/$name.pid"
}
wait_for() {  # what, seconds, command...
  local what=$1 secs=$2; shift 2
  for _ in $(seq 1 $(( secs * 4 ))); do "$@" >/dev/null 2>&1 && return 0; sleep 0.25; done
  echo "cluster: $what did not come up; see $dir/*.log" >&2
  tail -20 "$dir"/*.log >&2 || true
  return 1
}

bin="$("$here/build.sh")"
phase "binaries ready in $bin"
mkdir -p "$dir/pki" "$dir/etcd"

if [[ ! -f "$dir/pki/sa.key" ]]; then
  openssl genrsa -out "$dir/pki/sa.key" 2048 2>/dev/null
  openssl rsa -in "$dir/pki/sa.key" -pubout -out "$dir/pki/sa.pub" 2>/dev/null
  # A static token for the admin user: enough for a loopback-only test API server.
  echo "$(openssl rand -hex 16),slofleet-admin,slofleet-admin,system:masters" >"$dir/pki/tokens.csv"
fi
token="$(cut -d, -f1 "$dir/pki/tokens.csv")"
cat >"$kubeconfig" <<EOF
apiVersion: v1
kind: Config
clusters:
- name: slofleet-local
  # kube-apiserver writes its self-signed certificate and CA here when it first starts.
  cluster: {server: "https://127.0.0.1:$api_port", certificate-authority: "$dir/pki/apiserver.crt"}
users:
- name: slofleet-admin
  user: {token: "$token"}
contexts:
- name: slofleet-local
  context: {cluster: slofleet-local, user: slofleet-admin}
current-context: slofleet-local
EOF

start etcd "$bin/etcd" --name slofleet --data-dir "$dir/etcd" \
  --listen-client-urls "http://127.0.0.1:$etcd_port" --advertise-client-urls "http://127.0.0.1:$etcd_port" \
  --listen-peer-urls "http://127.0.0.1:$(( etcd_port + 1 ))" \
  --initial-advertise-peer-urls "http://127.0.0.1:$(( etcd_port + 1 ))" \
  --initial-cluster "slofleet=http://127.0.0.1:$(( etcd_port + 1 ))" \
  --unsafe-no-fsync --quota-backend-bytes 2147483648
wait_for etcd 30 curl -sf "http://127.0.0.1:$etcd_port/health"
phase "etcd up"

start kube-apiserver "$bin/kube-apiserver" \
  --etcd-servers "http://127.0.0.1:$etcd_port" \
  --bind-address 127.0.0.1 --advertise-address 127.0.0.1 --secure-port "$api_port" \
  --cert-dir "$dir/pki" --token-auth-file "$dir/pki/tokens.csv" \
  --authorization-mode RBAC \
  --service-account-issuer "https://kubernetes.default.svc" \
  --service-account-key-file "$dir/pki/sa.pub" --service-account-signing-key-file "$dir/pki/sa.key" \
  --service-cluster-ip-range 10.96.0.0/16 --allow-privileged=true \
  --enable-priority-and-fairness=false --profiling=false --watch-cache=true
wait_for kube-apiserver 90 kubectl --kubeconfig "$kubeconfig" get --raw /readyz
phase "kube-apiserver up on 127.0.0.1:$api_port"

# --root-ca-file: the CA it publishes in each namespace's kube-root-ca.crt, which pods' ServiceAccount volumes hold.
# No endpoint controllers: the API refuses the node runner's loopback pod IPs in Endpoints and EndpointSlices, so
# the runner publishes Services' endpoints itself (tests/cluster/services.py).
start kube-controller-manager "$bin/kube-controller-manager" \
  --kubeconfig "$kubeconfig" --authentication-kubeconfig "$kubeconfig" --authorization-kubeconfig "$kubeconfig" \
  --bind-address 127.0.0.1 --secure-port 0 --leader-elect=false \
  --service-account-private-key-file "$dir/pki/sa.key" --use-service-account-credentials=false \
  --root-ca-file "$dir/pki/apiserver.crt" \
  --controllers '*,-endpoints-controller,-endpointslice-controller,-node-ipam-controller,-node-lifecycle-controller,-persistentvolume-binder-controller,-persistentvolume-attach-detach-controller' \
  --concurrent-deployment-syncs 10 --concurrent-replicaset-syncs 10 --concurrent-gc-syncs 20
wait_for "default service account" 60 kubectl --kubeconfig "$kubeconfig" -n default get serviceaccount default
phase "kube-controller-manager up"

if [[ "${SLOFLEET_NODE_RUNNER:-1}" != 0 ]]; then
  start noderunner env PATH="${SLOFLEET_NODE_PATH:-$repo/.venv/bin:$PATH}" KUBECONFIG="$kubeconfig" \
    "$python" "$here/noderunner.py" --state-dir "$dir/pods"
  wait_for "node runner" 30 kubectl --kubeconfig "$kubeconfig" get node slofleet-node
  phase "test-only node runner up (node slofleet-node)"
fi
echo "export KUBECONFIG=$kubeconfig"
