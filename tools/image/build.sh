#!/usr/bin/env bash
# Builds the engine image without a registry or a container builder, and imports it into containerd:
#   1. a Debian root filesystem from Debian's packages (debootstrap, from the mirror apt already uses), cached
#      under ~/.cache/slofleet/image keyed by its package list;
#   2. /opt/slofleet: a venv on that Python holding the project's own environment ($PYTHON's site-packages, the
#      editable install left out) and the project as a wheel built from this checkout;
#   3. one OCI layer packed by tools/image/oci.py (non-root user, env and command as engine_image/Dockerfile's
#      engine stage), imported with `ctr images import` into the k8s.io namespace.
#   4. a pause image for pod sandboxes from the bare root filesystem (no registry to pull one from).
# The engine image's tag is keyed by the project's sources and environment: a warm run finds it and builds nothing.
# Needs root (debootstrap, chroot) and a running containerd. Env: PYTHON (the project's venv python),
# CONTAINERD_ADDRESS (its socket). Prints the engine image's name on stdout.
# With --cached it builds nothing: exit 3 when the image is not there (tests skip then, naming `make image`).
set -euo pipefail
repo="$(cd "$(dirname "$0")/../.." && pwd)"
python="${PYTHON:-$repo/.venv/bin/python}"
address="${CONTAINERD_ADDRESS:-/run/containerd/containerd.sock}"
sources="$(cd "$repo" && git ls-files -s pyproject.toml engine_image crds operator autoscaler tools/image | sha256sum)"
key="$( (echo "$sources"; "$python" -m pip freeze --exclude-editable 2>/dev/null) | sha256sum | cut -c1-12)"
image="docker.io/slofleet/engine:$key"
PAUSE_IMAGE="${PAUSE_IMAGE:-docker.io/slofleet/pause:local}"  # containerd's sandbox_image (tests/support/containers.py)
ctr_() { ctr -a "$address" -n k8s.io "$@"; }
if ctr_ images ls -q 2>/dev/null | grep -qx "$image"; then
  echo "$image"
  exit 0
elif [[ "${1:-}" == --cached ]]; then
  echo "the engine image is not built: make image" >&2
  exit 3
fi
# One engine image per machine: each commit's sources make a new tag of several GB, so the older ones are removed
# before this one is packed (containerd's garbage collector frees their content and snapshots), or the disk holds
# two of them at the peak.
# Every other name goes, the digest-named records the kubelet's CRI keeps beside each tag included (they hold the
# old content too); the pause image's tag stays.
ctr_ images ls -q | grep -vx -e "$image" -e "$PAUSE_IMAGE" | xargs -r ctr -a "$address" -n k8s.io \
  images rm --sync >&2 || true
packages="python3,python3-venv,ca-certificates"
cache="${SLOFLEET_IMAGE_CACHE:-$HOME/.cache/slofleet/image}"
base="$cache/rootfs-bookworm-$(echo "$packages" | sha256sum | cut -c1-12)"
if [[ ! -x "$base/usr/bin/python3" ]]; then
  mirror="$(awk '/^URIs:/ {print $2; exit}' /etc/apt/sources.list.d/debian.sources 2>/dev/null ||
            awk '/^deb / {print $2; exit}' /etc/apt/sources.list)"
  echo "debootstrap bookworm ($packages) into $base" >&2
  rm -rf "$base.tmp" && mkdir -p "$cache"
  debootstrap --variant=minbase --include="$packages" bookworm "$base.tmp" "$mirror" >&2
  mv "$base.tmp" "$base"
fi
work="$(mktemp -d "$cache/build.XXXXXX")"
trap 'rm -rf "$work"' EXIT
cp -al "$base" "$work/rootfs" 2>/dev/null || cp -a "$base" "$work/rootfs"
chroot "$work/rootfs" python3 -m venv --without-pip /opt/slofleet
site="$work/rootfs/opt/slofleet/lib/python3.11/site-packages"
# The project's environment, as its own setup installed it (every site-packages folder its python reads).
for dir in $("$python" -c 'import sys; print(" ".join(p for p in sys.path if p.endswith("site-packages")))'); do
  for entry in "$dir"/*; do
    case "$(basename "$entry")" in _slofleet.pth | __editable__* | slofleet-*.dist-info | slofleet) continue ;; esac
    cp -al "$entry" "$site/" 2>/dev/null || cp -a "$entry" "$site/"
  done
done
"$python" -m pip wheel -q --no-deps --no-build-isolation -w "$work/wheel" "$repo" >&2
"$python" -c 'import sys, zipfile; zipfile.ZipFile(sys.argv[1]).extractall(sys.argv[2])' "$work"/wheel/*.whl "$site"
printf '#!/opt/slofleet/bin/python3\nimport sys\nfrom slofleet.cli import main\nsys.exit(main())\n' \
  > "$work/rootfs/opt/slofleet/bin/slofleet"
chmod 755 "$work/rootfs/opt/slofleet/bin/slofleet"
"$python" "$repo/tools/image/oci.py" "$work/rootfs" "$work/image.tar" --name "$image" --user 10001:10001 \
  --env PATH=/opt/slofleet/bin:/usr/bin:/bin --env HOME=/tmp --env PYTHONDONTWRITEBYTECODE=1 \
  --cmd slofleet serve --host 0.0.0.0 --port 8000
ctr_ images import "$work/image.tar" >&2
rm -f "$work/image.tar"
"$python" "$repo/tools/image/oci.py" "$base" "$work/pause.tar" --name "$PAUSE_IMAGE" \
  --env PATH=/usr/bin:/bin --cmd /bin/sleep infinity
ctr_ images import "$work/pause.tar" >&2
echo "$image"
