# Real parts around the fleet, built once per machine into caches keyed by version and sources (a warm run costs
# nothing), and wired into `make test` like `prometheus`:
#   make epp         the Gateway API Inference Extension's endpoint picker and its ext-proc client (tools/epp)
#   make otelcol     an OpenTelemetry Collector: OTLP receiver, batch processor, file exporter (tools/otelcol)
#   make containerd  Debian's containerd, runc and debootstrap
#   make kubelet     a kubelet of the control plane's Kubernetes version (tools/kubelet)
#   make image       the engine image, built without a registry and imported into containerd (tools/image; root)
.PHONY: epp otelcol containerd kubelet image
epp:
	@tools/epp/build.sh >/dev/null

otelcol:
	@tools/otelcol/build.sh >/dev/null

containerd:
	@command -v containerd >/dev/null && command -v runc >/dev/null && command -v debootstrap >/dev/null || { \
	  echo "installing Debian's containerd, runc and debootstrap"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
	    containerd runc debootstrap >/dev/null; }

kubelet:
	@tools/kubelet/build.sh >/dev/null

image: install containerd
	$(PY) -m tests.support.containers image

test: epp otelcol kubelet image
