#!/usr/bin/env bash
# Builds a kubelet from the Kubernetes version the test control plane pins (tests/cluster/go.mod, one source of
# truth) into a cache outside the repo keyed by that module and this script, so a warm run costs nothing.
# It builds in a scratch copy of that module: the kubelet needs a few go.sum lines the control plane does not.
# Prints the binary's path on stdout; progress goes to stderr.
# With --cached it builds nothing: exit 3 when the build is not there yet (tests skip then, naming `make kubelet`).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
cluster="$here/../../tests/cluster"
k8s="$(awk '$1 == "k8s.io/kubernetes" {print $2}' "$cluster/go.mod")"
key="$(cat "$cluster/go.mod" "$cluster/go.sum" "$here/build.sh" | sha256sum | cut -c1-16)"
bin="${SLOFLEET_TOOLS_CACHE:-$HOME/.cache/slofleet/tools}/kubelet-$k8s-$key"
if [[ ! -x "$bin" && "${1:-}" == --cached ]]; then
  echo "the kubelet is not built: make kubelet" >&2
  exit 3
elif [[ ! -x "$bin" ]]; then
  echo "building the kubelet ($k8s) into $bin" >&2
  scratch="$(mktemp -d)"
  trap 'rm -rf "$scratch"' EXIT
  cp "$cluster/go.mod" "$cluster/go.sum" "$scratch/"
  mkdir -p "$scratch/cmd" && cp -r "$cluster/cmd/etcd" "$scratch/cmd/"  # the module's own tool, named in go.mod
  minor="$(echo "$k8s" | cut -d. -f2)"
  ldflags="-s -w -X k8s.io/component-base/version.gitVersion=$k8s -X k8s.io/component-base/version.gitMajor=1"
  ldflags+=" -X k8s.io/component-base/version.gitMinor=$minor -X k8s.io/component-base/version.gitTreeState=clean"
  mkdir -p "$(dirname "$bin")"
  (cd "$scratch" && GOFLAGS=-mod=mod CGO_ENABLED=0 go build -trimpath -ldflags="$ldflags" -o "$bin.tmp" \
    k8s.io/kubernetes/cmd/kubelet) >&2
  mv "$bin.tmp" "$bin"
fi
echo "$bin"
