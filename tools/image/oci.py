"""Pack a root filesystem folder into an OCI image archive that `ctr images import` takes, with no registry and no
container builder: one layer (the folder as a tar), an image config (user, env, entrypoint), a manifest and an index
naming the image.

    python tools/image/oci.py ROOTFS OUT.tar --name docker.io/slofleet/engine:local --user 10001:10001 \\
        --env PATH=/opt/slofleet/bin:/usr/bin:/bin --cmd slofleet serve
"""
from __future__ import annotations

import argparse
import hashlib
import io
import json
import sys
import tarfile
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

MANIFEST = "application/vnd.oci.image.manifest.v1+json"
CONFIG = "application/vnd.oci.image.config.v1+json"
LAYER = "application/vnd.oci.image.layer.v1.tar"


@dataclass(slots=True, kw_only=True)
class Image:
    name: str
    user: str = ""
    env: list[str] = field(default_factory=list)
    entrypoint: list[str] = field(default_factory=list)
    cmd: list[str] = field(default_factory=list)
    workdir: str = "/"


def digest_of(path: Path) -> tuple[str, int]:
    h, size = hashlib.sha256(), 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
            size += len(chunk)
    return h.hexdigest(), size


def add_blob(out: tarfile.TarFile, data: bytes) -> dict:
    sha = hashlib.sha256(data).hexdigest()
    info = tarfile.TarInfo(f"blobs/sha256/{sha}")
    info.size = len(data)
    out.addfile(info, io.BytesIO(data))
    return {"digest": f"sha256:{sha}", "size": len(data)}


def pack(rootfs: Path, dest: Path, image: Image) -> None:
    with tempfile.TemporaryDirectory(dir=dest.parent) as tmp:
        layer = Path(tmp) / "layer.tar"
        with tarfile.open(layer, "w", format=tarfile.PAX_FORMAT) as t:
            for child in sorted(rootfs.iterdir()):
                t.add(child, arcname=child.name)  # owners and modes as they are in the folder
        sha, size = digest_of(layer)
        config = {"architecture": "amd64", "os": "linux", "rootfs": {"type": "layers", "diff_ids": [f"sha256:{sha}"]},
                  "config": {"User": image.user, "Env": image.env, "Entrypoint": image.entrypoint or None,
                             "Cmd": image.cmd or None, "WorkingDir": image.workdir}}
        with tarfile.open(dest, "w") as out:
            out.add(layer, arcname=f"blobs/sha256/{sha}")
            cfg = add_blob(out, json.dumps(config).encode())
            manifest = {"schemaVersion": 2, "mediaType": MANIFEST, "config": {"mediaType": CONFIG, **cfg},
                        "layers": [{"mediaType": LAYER, "digest": f"sha256:{sha}", "size": size}]}
            man = add_blob(out, json.dumps(manifest).encode())
            index = {"schemaVersion": 2, "manifests": [{"mediaType": MANIFEST, **man, "annotations": {
                "io.containerd.image.name": image.name,
                "org.opencontainers.image.ref.name": image.name.rsplit(":", 1)[-1]}}]}
            add_blob_named(out, "index.json", json.dumps(index).encode())
            add_blob_named(out, "oci-layout", b'{"imageLayoutVersion": "1.0.0"}')


def add_blob_named(out: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    out.addfile(info, io.BytesIO(data))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("rootfs", type=Path)
    p.add_argument("dest", type=Path)
    p.add_argument("--name", required=True, help="the image's name, e.g. docker.io/slofleet/engine:local")
    p.add_argument("--user", default="")
    p.add_argument("--env", action="append", default=[])
    p.add_argument("--workdir", default="/")
    p.add_argument("--cmd", nargs=argparse.REMAINDER, default=[])
    args = p.parse_args(argv)
    if not args.rootfs.is_dir():
        print(f"oci.py: {args.rootfs} is not a folder", file=sys.stderr)
        return 2
    pack(args.rootfs, args.dest, Image(name=args.name, user=args.user, env=args.env, cmd=args.cmd,
                                       workdir=args.workdir))
    return 0


if __name__ == "__main__":
    sys.exit(main())
