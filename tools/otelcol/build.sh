#!/usr/bin/env bash
# Builds slofleet-otelcol (main.go: the OpenTelemetry Collector's OTLP receiver, batch processor and file exporter,
# at the release go.mod names) into a cache outside the repo keyed by the sources, so a warm run costs nothing.
# Prints the binary's path on stdout; progress goes to stderr.
# With --cached it builds nothing: exit 3 when the build is not there yet (tests skip then, naming `make otelcol`).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
version="$(cd "$here" && go list -m -f '{{.Version}}' go.opentelemetry.io/collector/otelcol)"
key="$(cat "$here/go.mod" "$here/go.sum" "$here/main.go" | sha256sum | cut -c1-16)"
bin="${SLOFLEET_TOOLS_CACHE:-$HOME/.cache/slofleet/tools}/otelcol-$version-$key"
if [[ ! -x "$bin" && "${1:-}" == --cached ]]; then
  echo "the collector is not built: make otelcol" >&2
  exit 3
elif [[ ! -x "$bin" ]]; then
  echo "building the OpenTelemetry Collector ($version) into $bin" >&2
  mkdir -p "$(dirname "$bin")"
  (cd "$here" && CGO_ENABLED=0 go build -trimpath -o "$bin.tmp" .) >&2
  mv "$bin.tmp" "$bin"
fi
echo "$bin"
