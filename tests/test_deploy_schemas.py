"""deploy/'s Kubernetes and Kubeflow manifests validate against the Kubernetes API schemas, offline.

``kubernetes-validate`` bundles the JSON schemas of each Kubernetes release
(generated from its OpenAPI spec), so nothing is fetched at test time. The
strict schemas refuse unknown fields: a misspelled key fails, as ``kubectl apply
--validate=strict`` would. Each object is validated against the oldest release
the manifests need (``OLDEST``: the worker Job's ``backoffLimitPerIndex`` is beta,
on by default, from 1.29) and the newest one bundled.

- ``deploy/k8s/*.yaml`` and the replicated overlay: each object against its kind's
  schema; the overlay rendered as kustomize would (its resources, then its patches
  applied as strategic merges, containers merged by name) and the result validated.
- ``kustomization.yaml`` files are kustomize's, not Kubernetes API objects (no
  schema): test_deploy.py checks the files they name.
- The Kubeflow ``TFJob`` is a custom resource, outside the Kubernetes schemas: its
  own fields against ``tests/schemas/tfjob-kubeflow.org-v1.json`` (written from the
  training operator's CRD, stricter than it), and each replica's pod template as a
  core/v1 ``PodTemplate``.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest

yaml = pytest.importorskip("yaml")
kubernetes_validate = pytest.importorskip("kubernetes_validate")
jsonschema = pytest.importorskip("jsonschema")

DEPLOY = Path(__file__).resolve().parents[1] / "deploy"
K8S = DEPLOY / "k8s"
TFJOB_SCHEMA = Path(__file__).resolve().parent / "schemas" / "tfjob-kubeflow.org-v1.json"
OLDEST = "1.29"
VERSIONS = (OLDEST, kubernetes_validate.latest_version())


def load(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def validate(obj: dict[str, Any], where: str) -> None:
    """Validates one object against every version in VERSIONS (strict schemas); fails naming the field."""
    for version in VERSIONS:
        try:
            kubernetes_validate.validate(obj, version, strict=True)
        except kubernetes_validate.ValidationError as err:
            field = ".".join(str(p) for p in err.path)
            pytest.fail(f"{where}: {obj['kind']}/{obj['metadata']['name']} invalid for Kubernetes {version}: "
                        f"{field}: {err.message}")  # fmt: skip


def strategic_merge(base: Any, patch: Any) -> Any:
    """kustomize's strategic merge for what these patches touch: maps merge, named lists merge by name.

    (Kubernetes merges containers, env and volumes by ``name``; other lists are replaced.)
    """
    if isinstance(base, dict) and isinstance(patch, dict):
        return {**base, **{k: strategic_merge(base[k], v) if k in base else v for k, v in patch.items()}}
    named = isinstance(base, list) and isinstance(patch, list)
    if named and all(isinstance(item, dict) and "name" in item for item in [*base, *patch]):
        merged = {item["name"]: item for item in base}
        for item in patch:
            name = item["name"]
            merged[name] = strategic_merge(merged[name], item) if name in merged else item
        return list(merged.values())
    return copy.deepcopy(patch)


def render(directory: Path) -> list[dict[str, Any]]:
    """The objects ``kubectl apply -k DIRECTORY`` would create (resources and patches only)."""
    kustomization = yaml.safe_load((directory / "kustomization.yaml").read_text())
    assert set(kustomization) <= {"apiVersion", "kind", "resources", "patches"}, "render() handles no more"
    objects: list[dict[str, Any]] = []
    for resource in kustomization["resources"]:
        path = (directory / resource).resolve()
        objects += render(path) if path.is_dir() else load(path)
    for patch_ref in kustomization.get("patches", []):
        patch = yaml.safe_load((directory / patch_ref["path"]).read_text())
        key = (patch["kind"], patch["metadata"]["name"])
        hits = [i for i, o in enumerate(objects) if (o["kind"], o["metadata"]["name"]) == key]
        assert len(hits) == 1, f"{patch_ref['path']} must patch exactly one object, matches {len(hits)}"
        objects[hits[0]] = strategic_merge(objects[hits[0]], patch)
    return objects


def test_every_kubernetes_manifest_validates() -> None:
    files = sorted(p for p in K8S.rglob("*.yaml") if p.name != "kustomization.yaml" and "patch" not in p.name)
    assert files, "no manifests found"
    kinds = set()
    for path in files:
        for obj in load(path):
            validate(obj, str(path.relative_to(DEPLOY)))
            kinds.add(obj["kind"])
    assert kinds == {"ConfigMap", "Service", "StatefulSet", "Job"}


@pytest.mark.parametrize("overlay", ["k8s", "k8s/replicated"])
def test_kustomizations_render_to_valid_objects(overlay: str) -> None:
    objects = render(DEPLOY / overlay)
    for obj in objects:
        validate(obj, f"kubectl apply -k deploy/{overlay}")
    names = {(o["kind"], o["metadata"]["name"]) for o in objects}
    assert len(names) == len(objects), "two objects of the same kind and name"
    if overlay == "k8s/replicated":
        sts = next(o for o in objects if (o["kind"], o["metadata"]["name"]) == ("StatefulSet", "ps"))
        container = sts["spec"]["template"]["spec"]["containers"][0]
        assert "--backup-at" in container["args"][0]  # the patch landed ...
        assert container["readinessProbe"]["grpc"]["port"] == 2222  # ... and kept the base's other fields


def test_kubeflow_tfjob_validates() -> None:
    (job,) = load(DEPLOY / "kubeflow" / "tfjob.yaml")
    jsonschema.Draft202012Validator(json.loads(TFJOB_SCHEMA.read_text())).validate(job)
    for replica, spec in job["spec"]["tfReplicaSpecs"].items():
        template = {
            "apiVersion": "v1",
            "kind": "PodTemplate",
            "metadata": {"name": f"tfjob-{replica.lower()}"},
            "template": spec["template"],
        }
        validate(template, f"deploy/kubeflow/tfjob.yaml replica {replica}")


def test_validation_refuses_what_kubernetes_would() -> None:
    """The checks above can fail: a misspelled field, a wrong type, an unknown TFJob replica type."""
    sts = next(o for o in load(K8S / "ps.yaml") if o["kind"] == "StatefulSet")
    typo = copy.deepcopy(sts)
    typo["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["grpc"]["servic"] = "x"
    wrong_type = copy.deepcopy(sts)
    wrong_type["spec"]["replicas"] = "2"
    for bad in (typo, wrong_type):
        with pytest.raises(kubernetes_validate.ValidationError):
            kubernetes_validate.validate(bad, OLDEST, strict=True)
    (job,) = load(DEPLOY / "kubeflow" / "tfjob.yaml")
    job["spec"]["tfReplicaSpecs"]["Workers"] = job["spec"]["tfReplicaSpecs"].pop("Worker")
    with pytest.raises(jsonschema.ValidationError, match="Workers"):
        jsonschema.Draft202012Validator(json.loads(TFJOB_SCHEMA.read_text())).validate(job)
