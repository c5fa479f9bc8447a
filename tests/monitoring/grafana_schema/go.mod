module slofleet.dev/tests/grafana-schema

go 1.22

require github.com/grafana/grafana-foundation-sdk/go v0.0.22
