"""The images slofleet's pods run, by role: the one source of their names and tag. The chart's values
(charts/slofleet/values.yaml), the manifests and engine_image/Dockerfile's targets mirror these, and
tests/operator/test_images.py keeps them equal. Standard library only, as contract.py."""
from __future__ import annotations

TAG = "0.1.0"  # the release: pyproject's version and the chart's appVersion
# `slofleet serve` (torch, triton, transformers, a C++ compiler for the CPU kernels), and the router under policy
# precise, which loads the engines' tokenizer: Dockerfile target `engine`.
ENGINE_REPOSITORY = "slofleet/engine"
# The operator, the autoscaler, and the router under every other policy: Dockerfile target `control`.
CONTROL_REPOSITORY = "slofleet/control"
ENGINE_IMAGE = f"{ENGINE_REPOSITORY}:{TAG}"
CONTROL_IMAGE = f"{CONTROL_REPOSITORY}:{TAG}"
