#!/usr/bin/env bash
# Builds grafana-schema (main.go) into a cache outside the repo keyed by its sources, so a warm run costs nothing.
# Prints the binary's path on stdout; progress goes to stderr.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
key="$(cat "$here/go.mod" "$here/go.sum" "$here/main.go" | sha256sum | cut -c1-16)"
bin="${SLOFLEET_TOOLS_CACHE:-$HOME/.cache/slofleet/tools}/grafana-schema-$key"
if [[ ! -x "$bin" ]]; then
  echo "building grafana-schema (Grafana Foundation SDK) into $bin" >&2
  mkdir -p "$(dirname "$bin")"
  (cd "$here" && CGO_ENABLED=0 go build -trimpath -o "$bin.tmp" .) >&2
  mv "$bin.tmp" "$bin"
fi
echo "$bin"
