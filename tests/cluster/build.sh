#!/usr/bin/env bash
# Builds the test control plane's binaries (kube-apiserver, kube-controller-manager, etcd, helm) in one
# `go build`, into a cache outside the repo keyed by go.sum, so a warm run costs nothing.
# Prints the bin directory on stdout; progress and timings go to stderr.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
key="$(cat "$here/go.sum" "$here/go.mod" "$here/cmd/etcd/main.go" "$here/build.sh" | sha256sum | cut -c1-16)"
bin="${SLOFLEET_K8S_CACHE:-$HOME/.cache/slofleet/k8s}/$key/bin"
tools=(kube-apiserver kube-controller-manager etcd helm)
missing=0
for t in "${tools[@]}"; do [[ -x "$bin/$t" ]] || missing=1; done
if [[ $missing == 1 ]]; then
  start=$(date +%s)
  echo "building ${tools[*]} into $bin (cold: tens of minutes on 2 cores)" >&2
  mkdir -p "$bin.tmp"
  # Version stamps that the upstream Makefiles set: without them the API server reports v0.0.0-master
  # (which helm's kubeVersion checks reject) and helm assumes Kubernetes 1.20.
  k8s="$(awk '$1 == "k8s.io/kubernetes" {print $2}' "$here/go.mod")"
  minor="$(echo "$k8s" | cut -d. -f2)"
  ldflags="-s -w -X k8s.io/component-base/version.gitVersion=$k8s -X k8s.io/component-base/version.gitMajor=1"
  ldflags+=" -X k8s.io/component-base/version.gitMinor=$minor -X k8s.io/component-base/version.gitTreeState=clean"
  ldflags+=" -X k8s.io/client-go/pkg/version.gitVersion=$k8s -X k8s.io/client-go/pkg/version.gitMajor=1"
  ldflags+=" -X k8s.io/client-go/pkg/version.gitMinor=$minor"
  for pkg in helm.sh/helm/v3/pkg/chartutil helm.sh/helm/v3/pkg/lint/rules; do
    ldflags+=" -X $pkg.k8sVersionMajor=1 -X $pkg.k8sVersionMinor=$minor"
  done
  (cd "$here" && CGO_ENABLED=0 go build -trimpath -ldflags="$ldflags" -o "$bin.tmp/" \
    k8s.io/kubernetes/cmd/kube-apiserver k8s.io/kubernetes/cmd/kube-controller-manager \
    helm.sh/helm/v3/cmd/helm ./cmd/etcd) >&2
  rm -rf "$bin" && mv "$bin.tmp" "$bin"
  echo "built in $(( $(date +%s) - start ))s" >&2
else
  echo "binaries cached in $bin" >&2
fi
echo "$bin"
