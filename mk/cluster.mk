# The local Kubernetes control plane for tests and for trying slofleet out (see tests/cluster/up.sh):
#   make cluster        build (cached) and start etcd, kube-apiserver, kube-controller-manager, node runner
#   make cluster-down   stop it (state kept);  make cluster-purge: stop and forget the cluster
#   make cluster-bins   only build the binaries (prints their folder)
.PHONY: cluster cluster-down cluster-purge cluster-bins crds
cluster: install
	PYTHON=$(abspath $(PY)) tests/cluster/up.sh

cluster-down:
	tests/cluster/down.sh

cluster-purge:
	tests/cluster/down.sh --purge

cluster-bins:
	tests/cluster/build.sh

# Regenerate crds/*.yaml (and its copies in the chart and manifests/) from the models in crds/slofleet/api.
crds: install
	$(PY) -m slofleet.api.crd
