# The local Kubernetes control plane for tests and for trying slofleet out (see tests/cluster/up.sh):
#   make cluster        build (cached) and start etcd, kube-apiserver, kube-controller-manager, node runner
#   make cluster-down   stop it (state kept);  make cluster-purge: stop and forget the cluster
#   make cluster-bins   only build the binaries (prints their folder)
#   make cluster-urls   where each Service answers from this machine (the node runner proxies it on loopback)
.PHONY: cluster cluster-down cluster-purge cluster-bins cluster-urls crds
CLUSTER_DIR ?= $(or $(SLOFLEET_CLUSTER_DIR),$(HOME)/.cache/slofleet/cluster)
cluster: install
	PYTHON=$(abspath $(PY)) tests/cluster/up.sh

cluster-down:
	tests/cluster/down.sh

cluster-purge:
	tests/cluster/down.sh --purge

cluster-bins:
	tests/cluster/build.sh

cluster-urls:
	@kubectl --kubeconfig $(CLUSTER_DIR)/kubeconfig get services -A \
	  -o custom-columns='NAMESPACE:.metadata.namespace,SERVICE:.metadata.name,LOCAL-URL:.metadata.annotations.slofleet\.dev/local-url'

# Regenerate crds/*.yaml (and its copies in the chart and manifests/) from the models in crds/slofleet/api, and
# the Grafana dashboard (charts/slofleet/dashboards/, manifests/dashboards/) from crds/slofleet/api/dashboard.py.
crds: install
	$(PY) -m slofleet.api.crd
	$(PY) -m slofleet.api.dashboard
