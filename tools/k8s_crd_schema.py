"""Write a strict JSON schema (draft 2020-12) from a CustomResourceDefinition, for offline validation.

    python tools/k8s_crd_schema.py CRD.yaml --version VERSION --source "PROJECT RELEASE, PATH" \
        [--opaque DOTTED.PATH ...] [--note TEXT] > deploy/k8s/schemas/GROUP/KIND-VERSION.json

deploy/k8s/schemas/jobset.x-k8s.io/jobset-v1alpha2.json came from JobSet v0.12.0's
config/components/crd/bases/jobset.x-k8s.io_jobsets.yaml with `--version v1alpha2 --opaque
spec.replicatedJobs.template` (its x-source and description record the rest).

The version's openAPIV3Schema becomes a JSON schema that rejects unknown fields the way the API
server does under strict field validation: every object with `properties` and no
`additionalProperties` (nor `x-kubernetes-preserve-unknown-fields`) gets `additionalProperties:
false`. Descriptions, defaults and the `x-kubernetes-*` annotations are dropped (CEL rules cannot be
expressed); `apiVersion` and `kind` become constants. `--opaque` paths (dotted, through arrays'
items) are replaced by `{"type": "object"}`: what sits there is validated by another means (the
deployment tests validate a JobSet's Job templates as batch/v1 Jobs with kubernetes-validate,
against the Kubernetes versions the manifests support, rather than against the copy frozen in the
CRD). Knows nothing about any particular CRD.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import yaml

_DROPPED = {"description", "default", "format"}


def strict(node: Any) -> Any:
    """The schema node with unknown fields rejected and documentation dropped."""
    if isinstance(node, list):
        return [strict(item) for item in node]
    if not isinstance(node, dict):
        return node
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key in _DROPPED or key.startswith("x-kubernetes-"):
            continue
        if key == "properties":
            out[key] = {name: strict(child) for name, child in value.items()}
        elif key in ("enum", "required"):
            out[key] = value
        else:
            out[key] = strict(value)
    if (
        "properties" in node
        and "additionalProperties" not in node
        and not node.get("x-kubernetes-preserve-unknown-fields")
    ):
        out["additionalProperties"] = False
    return out


def make_opaque(schema: dict[str, Any], path: str) -> None:
    node = schema
    for name in path.split("."):
        while node.get("type") == "array":
            node = node["items"]
        if name not in node.get("properties", {}):
            raise SystemExit(f"--opaque {path!r}: no property {name!r} in the schema")
        parent, node = node, node["properties"][name]
    parent["properties"][name] = {"type": "object"}


def crd_schema(
    crd: dict[str, Any], version: str, source: str, opaque: list[str], note: str
) -> dict[str, Any]:
    names = crd["spec"]["names"]
    group = crd["spec"]["group"]
    matches = [v for v in crd["spec"]["versions"] if v["name"] == version]
    if len(matches) != 1:
        served = [v["name"] for v in crd["spec"]["versions"]]
        raise SystemExit(f"version {version!r} is not in the CRD (it has {served})")
    body = strict(matches[0]["schema"]["openAPIV3Schema"])
    for path in opaque:
        make_opaque(body, path)
    body["properties"]["apiVersion"] = {"const": f"{group}/{version}"}
    body["properties"]["kind"] = {"const": names["kind"]}
    body["required"] = sorted(set(body.get("required", [])) | {"apiVersion", "kind", "metadata", "spec"})
    description = (
        "Written by tools/k8s_crd_schema.py from the openAPIV3Schema of the CustomResourceDefinition "
        "named in x-source (Apache License 2.0, like its project): descriptions, defaults and formats "
        "dropped, unknown fields rejected (additionalProperties: false) as the API server does with "
        "strict field validation. CEL x-kubernetes-validations rules are not expressed."
    )
    if note:
        description += " " + note
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "$id": f"https://furlong.dev/schemas/{group}/{names['singular']}-{version}.json",
        "title": f"{names['kind']} ({group}/{version})",
        "description": description,
        "x-source": source,
        **body,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("crd", type=Path)
    parser.add_argument("--version", required=True)
    parser.add_argument("--source", required=True, help="project, release and path of the CRD")
    parser.add_argument("--opaque", action="append", default=[], help="dotted path validated elsewhere")
    parser.add_argument("--note", default="", help="appended to the schema's description")
    args = parser.parse_args(argv)
    crds = [d for d in yaml.safe_load_all(args.crd.read_text()) if d]
    if len(crds) != 1 or crds[0].get("kind") != "CustomResourceDefinition":
        raise SystemExit(f"{args.crd}: expected one CustomResourceDefinition")
    schema = crd_schema(crds[0], args.version, args.source, args.opaque, args.note)
    json.dump(schema, sys.stdout, indent=1)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
