# Peer runtimes that slofleet's control plane also drives (docs/runtimes.md), cached outside the repo by version:
#   make install-runtimes   vLLM's CPU build in its own venv + llama.cpp's llama-server (cold: tens of minutes)
#   make runtimes-dirs      print where they are (the test fixtures and benchmarks/load.py look there too)
.PHONY: install-runtimes install-vllm install-llamacpp runtimes-dirs
install-runtimes: install-llamacpp install-vllm

install-vllm:
	tests/runtimes/install_vllm.sh

install-llamacpp:
	tests/runtimes/install_llamacpp.sh

runtimes-dirs:
	@$(PY) -c 'from slofleet.bench.runtimes import print_dirs; print_dirs()'
