#!/usr/bin/env bash
# `make chart-lint`: helm lint --strict, then kubeconform (strict, offline) on the rendered chart and on manifests/.
# kubeconform is built from its Go module and the built-in kinds' schemas are generated from the OpenAPI v3 of the
# k8s.io/kubernetes module the local cluster is built from (tests/cluster/go.mod), with the PrometheusRule's from
# the Prometheus operator module's CRD, all cached outside the repo keyed by version; the CRDs' schemas come from
# crds/ on every run. A warm run costs a few seconds.
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
python="${PYTHON:-$repo/.venv/bin/python}"
kubeconform_version=v0.8.0
prometheus_operator_version=v0.85.0
cache="${SLOFLEET_TOOLS_CACHE:-$HOME/.cache/slofleet/tools}"
chart="$repo/charts/slofleet"
mkdir -p "$cache"

helm="$("$repo/tests/cluster/build.sh")/helm"
kubeconform="$cache/kubeconform-$kubeconform_version/kubeconform"
if [[ ! -x $kubeconform ]]; then
  echo "building kubeconform $kubeconform_version into ${kubeconform%/*}" >&2
  CGO_ENABLED=0 GOBIN="${kubeconform%/*}" \
    go install -trimpath -ldflags='-s -w' "github.com/yannh/kubeconform/cmd/kubeconform@$kubeconform_version" >&2
fi
k8s="$(awk '$1 == "k8s.io/kubernetes" {print $2}' "$repo/tests/cluster/go.mod")"
key="$(sha256sum "$repo/tools/kube_schemas.py" | cut -c1-12)"
builtin="$cache/kube-schemas-$k8s-$prometheus_operator_version-$key"
module_dir() { go mod download -json "$1" | "$python" -c 'import json, sys; print(json.load(sys.stdin)["Dir"])'; }
if [[ ! -d $builtin ]]; then
  kubernetes="$(cd "$repo/tests/cluster" && module_dir k8s.io/kubernetes)"
  prometheus="$(cd "$cache" && module_dir "github.com/prometheus-operator/prometheus-operator@$prometheus_operator_version")"
  "$python" "$repo/tools/kube_schemas.py" --openapi "$kubernetes/api/openapi-spec/v3" --out "$builtin.tmp" \
    --crd "$prometheus/example/prometheus-operator-crd/monitoring.coreos.com_prometheusrules.yaml"
  rm -rf "$builtin" && mv "$builtin.tmp" "$builtin"
fi
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
crd_args=()
for f in "$repo"/crds/*.yaml; do crd_args+=(--crd "$f"); done
"$python" "$repo/tools/kube_schemas.py" "${crd_args[@]}" --out "$work/crds" 2>/dev/null

# Every template path: the defaults, everything optional on, the autoscaler off.
variants=("" "--set monitoring.prometheusRule.enabled=true,autoscaler.prometheus=http://prometheus:9090"
          "--set autoscaler.enabled=false,networkPolicy.enabled=false,monitoring.dashboard.enabled=false")
for v in "${variants[@]}"; do
  # shellcheck disable=SC2086
  "$helm" lint --strict "$chart" $v
  # shellcheck disable=SC2086
  "$helm" template slofleet "$chart" --namespace slofleet-system --include-crds $v >>"$work/chart.yaml"
  echo "---" >>"$work/chart.yaml"
done
# kustomize's own file is no Kubernetes object.
kc=("$kubeconform" -strict -summary -skip Kustomization
    -schema-location "$builtin/{{ .ResourceKind }}{{ .KindSuffix }}.json"
    -schema-location "$work/crds/{{ .ResourceKind }}{{ .KindSuffix }}.json")
"${kc[@]}" "$work/chart.yaml"
"${kc[@]}" "$repo"/manifests/*.yaml "$repo"/manifests/crds/*.yaml "$repo"/manifests/examples/*.yaml
