"""A reader of deploy/k8s as `kubectl kustomize` would build it, for the manifest tests.

It handles the subset the manifests use, and fails on anything else (so a manifest that
grows a feature must grow the test too): `resources` (files and directories with a
kustomization.yaml), `images` (newName / newTag) and `patches` with a JSON 6902 patch
file and a target by kind, name and an equality labelSelector.
"""
from __future__ import annotations

import copy
import pathlib

import yaml

KUSTOMIZATION_KEYS = {"apiVersion", "kind", "resources", "images", "patches"}


def render(directory: pathlib.Path) -> list[dict]:
    k = yaml.safe_load((directory / "kustomization.yaml").read_text())
    unknown = set(k) - KUSTOMIZATION_KEYS
    assert not unknown, f"{directory}: kustomization fields the test cannot render: {unknown}"
    assert k["kind"] == "Kustomization"
    docs: list[dict] = []
    for res in k.get("resources", []):
        path = (directory / res).resolve()
        if path.is_dir():
            docs += render(path)
        else:
            docs += [d for d in yaml.safe_load_all(path.read_text()) if d]
    for image in k.get("images", []):
        _set_image(docs, image)
    for patch in k.get("patches", []):
        assert set(patch) == {"path", "target"}, f"unsupported patch form {patch}"
        ops = yaml.safe_load((directory / patch["path"]).read_text())
        targets = [d for d in docs if _matches(d, patch["target"])]
        assert targets, f"patch {patch['path']} matches nothing"
        for d in targets:
            apply_json_patch(d, ops)
    return docs


def _matches(doc: dict, target: dict) -> bool:
    unknown = set(target) - {"kind", "name", "labelSelector"}
    assert not unknown, f"unsupported patch target fields {unknown}"
    if "kind" in target and doc["kind"] != target["kind"]:
        return False
    if "name" in target and doc["metadata"]["name"] != target["name"]:
        return False
    labels = doc["metadata"].get("labels") or {}
    for term in filter(None, target.get("labelSelector", "").split(",")):
        key, _, value = term.partition("=")
        if labels.get(key.strip()) != value.strip():
            return False
    return True


def pod_spec(doc: dict) -> dict | None:
    return doc["spec"]["template"]["spec"] if doc["kind"] in (
        "Deployment", "StatefulSet", "DaemonSet", "Job") else None


def _set_image(docs: list[dict], image: dict) -> None:
    for doc in docs:
        spec = pod_spec(doc)
        for c in (spec or {}).get("containers", []):
            name, _, _tag = c["image"].partition(":")
            if name == image["name"]:
                c["image"] = f"{image.get('newName', name)}:{image['newTag']}"


def _pointer(path: str) -> list[str]:
    assert path.startswith("/"), path
    return [p.replace("~1", "/").replace("~0", "~") for p in path[1:].split("/")]


def apply_json_patch(doc: dict, ops: list[dict]) -> None:
    """RFC 6902 add / replace / remove / test (the ops kustomize applies)."""
    for op in ops:
        *parents, last = _pointer(op["path"])
        node = doc
        for p in parents:
            node = node[int(p)] if isinstance(node, list) else node[p]
        kind = op["op"]
        if isinstance(node, list):
            index = len(node) if last == "-" else int(last)
            if kind == "add":
                node.insert(index, copy.deepcopy(op["value"]))
            elif kind == "replace":
                node[index] = copy.deepcopy(op["value"])
            elif kind == "remove":
                del node[index]
            elif kind == "test":
                assert node[index] == op["value"], f"patch test failed at {op['path']}"
            else:
                raise AssertionError(f"unsupported patch op {kind}")
        else:
            if kind in ("add", "replace"):
                assert kind == "add" or last in node, f"replace of missing {op['path']}"
                node[last] = copy.deepcopy(op["value"])
            elif kind == "remove":
                del node[last]
            elif kind == "test":
                assert node.get(last) == op["value"], f"patch test failed at {op['path']}"
            else:
                raise AssertionError(f"unsupported patch op {kind}")
