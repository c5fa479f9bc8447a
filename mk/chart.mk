# The chart and manifests/ checked as a cluster would read them (also part of `make lint`): helm lint --strict and
# kubeconform, strict and offline, with the CRDs' schemas (tools/chart_lint.sh; builds helm and kubeconform, cached).
.PHONY: chart-lint
chart-lint: install
	PYTHON=$(abspath $(PY)) tools/chart_lint.sh

lint: chart-lint
