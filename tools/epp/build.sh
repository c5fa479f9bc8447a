#!/usr/bin/env bash
# Builds the Gateway API Inference Extension's endpoint picker (cmd/epp, the version go.mod names) and epp-pick
# (main.go, a gateway's ext-proc side) into a cache outside the repo keyed by the sources, and copies the
# extension's CRDs from that module beside them. Prints the folder on stdout; progress goes to stderr.
# With --cached it builds nothing: exit 3 when the build is not there yet (tests skip then, naming `make epp`).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
module=sigs.k8s.io/gateway-api-inference-extension
version="$(cd "$here" && go list -m -f '{{.Version}}' "$module")"
key="$(cat "$here/go.mod" "$here/go.sum" "$here/main.go" | sha256sum | cut -c1-16)"
out="${SLOFLEET_TOOLS_CACHE:-$HOME/.cache/slofleet/tools}/epp-$version-$key"
if [[ ! -x "$out/epp" && "${1:-}" == --cached ]]; then
  echo "the endpoint picker is not built: make epp" >&2
  exit 3
elif [[ ! -x "$out/epp" ]]; then
  echo "building the endpoint picker ($module $version) into $out" >&2
  mkdir -p "$out.tmp/crds"
  (cd "$here" && CGO_ENABLED=0 go build -trimpath -o "$out.tmp/epp" "$module/cmd/epp" &&
    CGO_ENABLED=0 go build -trimpath -o "$out.tmp/epp-pick" .) >&2
  src="$(cd "$here" && go list -m -f '{{.Dir}}' "$module")"
  cp "$src"/config/crd/bases/*.yaml "$out.tmp/crds/"
  chmod -R u+w "$out.tmp"
  rm -rf "$out" && mv "$out.tmp" "$out"
fi
echo "$out"
