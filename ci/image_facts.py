"""Sizes and settings of images pushed to an OCI layout (``buildah push IMG oci:DIR:TAG``), one line each.

    python ci/image_facts.py OCI_DIR RUNTIME_CONFIG_JSON --tags base builder runtime [--export-wheel-layer OUT]

For each tag: total gzip-compressed size (the layer blobs as pushed, what a registry stores and a pull moves)
and uncompressed size (the layers' tar streams); for the last tag, every layer with the build step that made
it (layers shared with the first tag are named as its). RUNTIME_CONFIG_JSON is the ``Docker.config`` object of ``buildah inspect`` of the runtime image (the OCI config
has no healthcheck). ``--export-wheel-layer`` copies the gzip layer of the step that installs the project
wheel (``pip install ... flash_qla_aot-*.whl``) to OUT.
"""
from __future__ import annotations

import argparse
import gzip
import json
import os
import re
import shutil
import sys
from typing import Dict, List

MIB = 1024 * 1024


def blob_path(layout: str, digest: str) -> str:
    algorithm, value = digest.split(":", 1)
    return os.path.join(layout, "blobs", algorithm, value)


def load_blob(layout: str, digest: str) -> dict:
    with open(blob_path(layout, digest)) as f:
        return json.load(f)


def manifests_by_tag(layout: str) -> Dict[str, dict]:
    with open(os.path.join(layout, "index.json")) as f:
        index = json.load(f)
    return {m["annotations"]["org.opencontainers.image.ref.name"]: load_blob(layout, m["digest"])
            for m in index["manifests"]}


def uncompressed_size(path: str, cache: Dict[str, int]) -> int:
    if path not in cache:
        total = 0
        with gzip.open(path, "rb") as f:
            while chunk := f.read(4 * MIB):
                total += len(chunk)
        cache[path] = total
    return cache[path]


def layer_steps(config: dict) -> List[str]:
    """The build step of each layer, in layer order (history entries that made no layer are skipped)."""
    return [h.get("created_by", "?") for h in config.get("history", []) if not h.get("empty_layer")]


def short(step: str, width: int = 90) -> str:
    step = " ".join(step.replace("/bin/sh -c ", "").split())
    step = re.sub(r"^\|\d+ (\S+=\S* )*", "RUN ", step)  # a RUN's recorded build arguments: '|3 A=1 B= C=2 cmd'
    return step if len(step) <= width else step[:width - 3] + "..."


def mb(n: int) -> str:
    return f"{n / MIB:,.1f} MiB"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("layout")
    p.add_argument("runtime_config")
    p.add_argument("--tags", nargs="+", required=True)
    p.add_argument("--export-wheel-layer", metavar="OUT")
    args = p.parse_args()

    manifests = manifests_by_tag(args.layout)
    cache: Dict[str, int] = {}
    for tag in args.tags:
        layers = manifests[tag]["layers"]
        packed = sum(layer["size"] for layer in layers)
        unpacked = sum(uncompressed_size(blob_path(args.layout, layer["digest"]), cache) for layer in layers)
        print(f"image {tag}: {len(layers)} layers, {mb(packed)} compressed (gzip), {mb(unpacked)} uncompressed")

    last = args.tags[-1]
    manifest = manifests[last]
    steps = layer_steps(load_blob(args.layout, manifest["config"]["digest"]))
    if len(steps) != len(manifest["layers"]):
        print(f"note: {len(steps)} history entries with layers for {len(manifest['layers'])} layers", file=sys.stderr)
        steps = (["?"] * len(manifest["layers"]) + steps)[-len(manifest["layers"]):]
    base_layers = {layer["digest"] for layer in manifests[args.tags[0]]["layers"]}
    wheel_layer = None
    for i, (layer, step) in enumerate(zip(manifest["layers"], steps)):
        size = uncompressed_size(blob_path(args.layout, layer["digest"]), cache)
        made_by = f"the {args.tags[0]} image's layer" if layer["digest"] in base_layers else short(step)
        print(f"  {last} layer {i}: {mb(layer['size'])} compressed, {mb(size)} uncompressed: {made_by}")
        if "pip install" in step and "flash_qla_aot-" in step:
            wheel_layer = layer

    with open(args.runtime_config) as f:
        config = json.load(f)
    health = config.get("Healthcheck") or {}
    print(f"runtime config: User {config.get('User')!r}, WorkingDir {config.get('WorkingDir')!r}, "
          f"ExposedPorts {sorted((config.get('ExposedPorts') or {}))}")
    print(f"runtime config: Entrypoint {config.get('Entrypoint')} Cmd {config.get('Cmd')}")
    if health:
        print(f"runtime config: Healthcheck {health.get('Test')} every {health.get('Interval', 0) / 1e9:g} s, "
              f"timeout {health.get('Timeout', 0) / 1e9:g} s, start period {health.get('StartPeriod', 0) / 1e9:g} s, "
              f"retries {health.get('Retries')}")
    else:
        print("runtime config: NO Healthcheck")

    if args.export_wheel_layer:
        if wheel_layer is None:
            print("no layer of a 'pip install ... flash_qla_aot-*.whl' step to export", file=sys.stderr)
            return 1
        os.makedirs(os.path.dirname(os.path.abspath(args.export_wheel_layer)), exist_ok=True)
        shutil.copyfile(blob_path(args.layout, wheel_layer["digest"]), args.export_wheel_layer)
        print(f"exported the wheel layer ({mb(wheel_layer['size'])} gzip) to {args.export_wheel_layer}")
    return 0 if health else 1


if __name__ == "__main__":
    sys.exit(main())
