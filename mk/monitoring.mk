# Real monitoring tools for the tests: Prometheus and promtool from Debian's `prometheus` package (the SLO burn
# rules are linted and unit-tested with promtool, and a real Prometheus scrapes an engine and a router).
.PHONY: prometheus check-rules
prometheus:
	@command -v prometheus >/dev/null && command -v promtool >/dev/null || { \
	  echo "installing Debian's prometheus package (prometheus, promtool)"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
	    prometheus >/dev/null; }

test: prometheus

# promtool's lint and unit tests on the chart's rules (also part of `make test`).
check-rules: install prometheus
	$(PY) -m pytest -q tests/monitoring/test_prometheus.py -k "lint or alert"
