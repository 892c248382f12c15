"""deployments/k8s validated offline: core objects against the Kubernetes JSON schemas that
kubernetes-validate ships (strict: unknown keys are errors), the RayCluster against the facts of
KubeRay's CRD transcribed below, and every pod template inside it as a core PodTemplate. Then the
wiring between the files (one image, the shared run folder at one path, the head's Service name
in the pipeline config), and mutated copies that must fail."""

import copy
import re
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml

from conftest import ROOT

K8S = ROOT / "deployments" / "k8s"
KUBERNETES_VERSION = "1.33.0"  # kubernetes-validate 1.37.0 ships 1.25-1.37; 1.33: the oldest minor still supported
NOT_MANIFESTS = {"kustomization.yaml", "prefect.yaml"}  # kustomize's own file; Prefect's deployments file
RUN_DIR = "/opt/eagle3/runs"  # docker/worker.Dockerfile: WORKDIR /opt/eagle3; the config's run_dir "runs/NAME"
HF_CACHE = "/root/.cache/huggingface"

# KubeRay's RayCluster CRD, version ray.io/v1 (served and stored), from ray-project/kuberay
# ray-operator/config/crd/bases/ray.io_rayclusters.yaml at tag v1.7.0, commit
# 59d663aeec13760646da3db9c1cf8cfe883e30b7 (identical on these fields at master feeaf72, 2026-08-19).
# Transcribed: spec, headGroupSpec and a workerGroupSpecs item, each with its complete list of properties,
# their types (int32 integers, string-valued maps) and required fields; the pod templates' own schema
# is the core PodTemplateSpec (the CRD embeds it), so they are checked by kubernetes-validate instead.
# The CRD does not forbid unknown keys, but the API server prunes them and `kubectl apply` (field
# validation Strict by default since Kubernetes 1.27) rejects them, hence additionalProperties false here.
INT32 = {"type": "integer", "minimum": -(2**31), "maximum": 2**31 - 1}
STRING_MAP = {"type": "object", "additionalProperties": {"type": "string"}}
OBJECT = {"type": "object"}
BOOL = {"type": "boolean"}
POD_TEMPLATE = {
    "type": "object",
    "properties": {
        "metadata": OBJECT,
        "spec": {
            "type": "object",
            "required": ["containers"],
            "properties": {
                "containers": {"type": "array", "items": {"type": "object", "required": ["name"]}},
            },
        },
    },
}
HEAD_GROUP = {
    "type": "object",
    "required": ["template"],
    "additionalProperties": False,
    "properties": {
        "enableIngress": BOOL,
        "headService": OBJECT,
        "ingressOptions": OBJECT,
        "labels": STRING_MAP,
        "rayStartParams": STRING_MAP,
        "resources": STRING_MAP,
        "serviceType": {"type": "string"},
        "template": POD_TEMPLATE,
    },
}
WORKER_GROUP = {
    "type": "object",
    "required": ["groupName", "maxReplicas", "minReplicas", "template"],
    "additionalProperties": False,
    "properties": {
        "groupName": {"type": "string"},
        "idleTimeoutSeconds": INT32,
        "labels": STRING_MAP,
        "maxReplicas": INT32,
        "minReplicas": INT32,
        "numOfHosts": INT32,
        "priority": INT32,
        "rayStartParams": STRING_MAP,
        "replicas": INT32,
        "resources": STRING_MAP,
        "scaleStrategy": OBJECT,
        "suspend": BOOL,
        "template": POD_TEMPLATE,
    },
}
RAYCLUSTER_SCHEMA = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "ray.io/v1"},
        "kind": {"const": "RayCluster"},
        "metadata": {"type": "object", "required": ["name"]},
        "spec": {
            "type": "object",
            "required": ["headGroupSpec"],
            "additionalProperties": False,
            "properties": {
                "authOptions": OBJECT,
                "autoscalerOptions": OBJECT,
                "enableInTreeAutoscaling": BOOL,
                "gcsFaultToleranceOptions": OBJECT,
                "headGroupSpec": HEAD_GROUP,
                "headServiceAnnotations": STRING_MAP,
                "historyServerOptions": OBJECT,
                "managedBy": {"enum": ["ray.io/kuberay-operator", "kueue.x-k8s.io/multikueue"]},
                "networkPolicy": OBJECT,
                "rayVersion": {"type": "string"},
                "suspend": BOOL,
                "tlsOptions": OBJECT,
                "upgradeStrategy": OBJECT,
                "workerGroupSpecs": {"type": "array", "items": WORKER_GROUP},
            },
        },
    },
}


def manifests() -> list[tuple[str, dict]]:
    """(file name, object) for every object in every manifest file."""
    out = []
    for path in sorted(K8S.glob("*.yaml")):
        if path.name not in NOT_MANIFESTS:
            out += [(path.name, doc) for doc in yaml.safe_load_all(path.read_text()) if doc is not None]
    return out


def by_kind(kind: str) -> list[dict]:
    return [doc for _, doc in manifests() if doc["kind"] == kind]


def one(kind: str) -> dict:
    found = by_kind(kind)
    assert len(found) == 1, f"expected one {kind}, found {len(found)}"
    return found[0]


def validate_core(doc: dict) -> None:
    kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)


def pod_templates(raycluster: dict) -> list[tuple[str, dict]]:
    spec = raycluster["spec"]
    return [("head", spec["headGroupSpec"]["template"])] + [
        (group["groupName"], group["template"]) for group in spec.get("workerGroupSpecs", [])
    ]


def validate_raycluster(doc: dict) -> None:
    """The CRD's facts, then each pod template as the core PodTemplate it embeds."""
    jsonschema.Draft202012Validator(RAYCLUSTER_SCHEMA).validate(doc)
    for group, template in pod_templates(doc):
        wrapped = {
            "apiVersion": "v1",
            "kind": "PodTemplate",
            "metadata": {"name": f"{doc['metadata']['name']}-{group}"},
            "template": template,
        }
        validate_core(wrapped)


def validate(doc: dict) -> None:
    if doc["apiVersion"].startswith("ray.io/"):
        validate_raycluster(doc)
    else:
        validate_core(doc)


def pod_specs() -> list[tuple[str, dict]]:
    """(where, pod spec) of every pod the manifests start."""
    specs = [(f"RayCluster {group}", t["spec"]) for group, t in pod_templates(one("RayCluster"))]
    specs += [(f"Deployment {d['metadata']['name']}", d["spec"]["template"]["spec"]) for d in by_kind("Deployment")]
    return specs


def mount_of(pod: dict, path: str) -> dict:
    """The volume mounted at ``path`` in the pod's first container."""
    mounts = {m["mountPath"]: m["name"] for m in pod["containers"][0].get("volumeMounts", [])}
    assert path in mounts, f"nothing mounted at {path}"
    return next(v for v in pod["volumes"] if v["name"] == mounts[path])


def test_every_manifest_parses_and_the_kustomization_lists_them():
    files = {p.name for p in K8S.glob("*.yaml")} - NOT_MANIFESTS
    assert files, "deployments/k8s holds no manifests"
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    assert set(kustomization["resources"]) == files, "kustomization.yaml must list every manifest, and only those"
    assert not list(K8S.glob("*.yml")) and not list(K8S.glob("*.json")), "manifests end in .yaml"
    kinds = {doc["kind"] for _, doc in manifests()}
    assert {"RayCluster", "PersistentVolumeClaim", "ConfigMap", "ServiceAccount", "Deployment"} <= kinds
    names = [(doc["kind"], doc["metadata"]["name"]) for _, doc in manifests()]
    assert len(names) == len(set(names)), "two objects share a kind and name"


def test_core_objects_validate_against_the_kubernetes_schemas():
    checked = 0
    for name, doc in manifests():
        if not doc["apiVersion"].startswith("ray.io/"):
            try:
                validate_core(doc)
            except kubernetes_validate.ValidationError as exc:
                raise AssertionError(f"{name}: {doc['kind']}/{doc['metadata']['name']}: {exc.message}") from None
            checked += 1
    assert checked >= 5


def test_raycluster_validates_against_kuberays_crd_and_its_pod_templates_as_core_pods():
    validate_raycluster(one("RayCluster"))


def test_raycluster_shape():
    cluster = one("RayCluster")
    spec = cluster["spec"]
    pinned = re.search(r"^ray\[default\]==(\S+)", (ROOT / "requirements" / "pipeline.txt").read_text(), re.M)
    assert pinned and spec["rayVersion"] == pinned.group(1), "rayVersion must be the image's Ray (KubeRay's probes)"
    head = spec["headGroupSpec"]["rayStartParams"]
    assert head["num-gpus"] == "0" and head["include-dashboard"] == "true" and head["dashboard-host"] == "0.0.0.0"
    head_pod = spec["headGroupSpec"]["template"]["spec"]
    assert "nvidia.com/gpu" not in str(head_pod["containers"][0]["resources"])
    ports = {p["containerPort"] for p in head_pod["containers"][0]["ports"]}
    assert {6379, 8265} <= ports
    gpu_groups = [
        g
        for g in spec["workerGroupSpecs"]
        if "nvidia.com/gpu" in g["template"]["spec"]["containers"][0]["resources"]["limits"]
    ]
    assert gpu_groups, "no worker group asks for GPUs"
    for group in gpu_groups:
        assert group["minReplicas"] <= group["replicas"] <= group["maxReplicas"], group["groupName"]
        resources = group["template"]["spec"]["containers"][0]["resources"]
        assert int(resources["limits"]["nvidia.com/gpu"]) >= 1
        # Kubernetes refuses an extended resource whose request differs from its limit.
        assert (
            resources["requests"].get("nvidia.com/gpu", resources["limits"]["nvidia.com/gpu"])
            == (resources["limits"]["nvidia.com/gpu"])
        )


def test_every_pod_runs_one_image_with_the_shared_run_folder_at_the_same_path():
    pvcs = {p["metadata"]["name"]: p for p in by_kind("PersistentVolumeClaim")}
    images = set()
    for where, pod in pod_specs():
        images.add(pod["containers"][0]["image"])
        runs = mount_of(pod, RUN_DIR)
        claim = runs["persistentVolumeClaim"]["claimName"]
        assert claim in pvcs, f"{where}: claim {claim} is not defined"
        assert pvcs[claim]["spec"]["accessModes"] == ["ReadWriteMany"], f"{claim}: every node writes the run folder"
        cache = mount_of(pod, HF_CACHE)["persistentVolumeClaim"]["claimName"]
        assert cache in pvcs, f"{where}: claim {cache} is not defined"
        shm = mount_of(pod, "/dev/shm")["emptyDir"]
        assert shm["medium"] == "Memory" and shm["sizeLimit"], f"{where}: /dev/shm must be a sized memory emptyDir"
        limits = pod["containers"][0]["resources"]
        assert limits.get("requests") and limits.get("limits"), f"{where}: requests and limits"
    assert len(images) == 1, f"every pod must run the same image (Ray's and Python's versions must match): {images}"


def test_the_worker_drives_the_clusters_head_and_the_config_names_it():
    from eagle3.config import PipelineConfig

    head_service = f"{one('RayCluster')['metadata']['name']}-head-svc:6379"  # KubeRay's name for the head Service
    config_map = one("ConfigMap")
    assert config_map["data"]["EAGLE3_RAY_HEAD"] == head_service
    assert config_map["data"]["PREFECT_API_URL"].endswith("/api")

    deployment = one("Deployment")
    assert (
        deployment["spec"]["selector"]["matchLabels"].items()
        <= deployment["spec"]["template"]["metadata"]["labels"].items()
    )
    pod = deployment["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == one("ServiceAccount")["metadata"]["name"]
    sources = {next(iter(ref.values()))["name"] for ref in pod["containers"][0]["envFrom"]}
    assert sources == {config_map["metadata"]["name"], "eagle3-keys"}
    script = pod["containers"][0]["args"][0]
    assert 'ray start --address="$EAGLE3_RAY_HEAD" --num-cpus=0 --num-gpus=0 --block' in script
    pool = re.search(r"prefect worker start --pool (\S+) --type process", script).group(1)
    assert "deployments/k8s/prefect.yaml" in script and (K8S / "prefect.yaml").exists()

    prefect = yaml.safe_load((K8S / "prefect.yaml").read_text())
    for entry in prefect["deployments"]:
        assert entry["work_pool"]["name"] == pool, entry["name"]
        path, func = entry["entrypoint"].split(":")
        assert (ROOT / path).exists(), entry["entrypoint"]
        config = PipelineConfig.model_validate(entry["parameters"]["config"])
        assert config.cluster.address == head_service, entry["name"]
        assert Path(config.run_dir).parts[0] == "runs" and not Path(config.run_dir).is_absolute(), (
            f"{entry['name']}: run_dir must be under runs/, the shared volume at {RUN_DIR}"
        )


def auth_problems(docs: list[dict]) -> list[str]:
    """Where the manifests break the rule for the Prefect credential: the worker presents
    PREFECT_API_AUTH_STRING from a Secret's key (the one Prefect's Helm chart reads for the server,
    auth-string), never as a value, and no manifest holds the Secret itself (created by hand)."""
    problems = []
    for doc in docs:
        if doc["kind"] == "Secret":
            data = {**doc.get("data", {}), **doc.get("stringData", {})}
            problems += [f"Secret {doc['metadata']['name']} holds {k}" for k in data if "AUTH" in k.upper()]
        if doc["kind"] != "Deployment":
            continue
        container = doc["spec"]["template"]["spec"]["containers"][0]
        env = {e["name"]: e for e in container.get("env", [])}
        auth = env.get("PREFECT_API_AUTH_STRING")
        if auth is None:
            problems.append("the worker does not present PREFECT_API_AUTH_STRING")
            continue
        if "value" in auth or "secretKeyRef" not in auth.get("valueFrom", {}):
            problems.append("PREFECT_API_AUTH_STRING must come from a Secret (valueFrom.secretKeyRef), not a value")
        elif auth["valueFrom"]["secretKeyRef"].get("key") != "auth-string":
            problems.append("PREFECT_API_AUTH_STRING: the Secret's key is auth-string (Prefect's Helm chart's)")
        problems += [f"{name} has a value" for name, e in env.items() if "AUTH" in name and "value" in e]
    return problems


def test_the_worker_presents_the_prefect_credential_from_a_secret_never_a_literal():
    docs = [doc for _, doc in manifests()]
    assert auth_problems(docs) == []
    ref = one("Deployment")["spec"]["template"]["spec"]["containers"][0]["env"]
    assert {
        "name": "PREFECT_API_AUTH_STRING",
        "valueFrom": {"secretKeyRef": {"name": "prefect-auth", "key": "auth-string"}},
    } in ref
    # The check bites: a literal, a Secret in the manifests holding it, a missing entry.
    literal = mutated(
        "Deployment", lambda d: d["spec"]["template"]["spec"]["containers"][0]["env"][0].update({"value": "admin:pass"})
    )
    assert any("not a value" in p for p in auth_problems([literal]))
    missing = mutated("Deployment", lambda d: d["spec"]["template"]["spec"]["containers"][0].pop("env"))
    assert auth_problems([missing]) == ["the worker does not present PREFECT_API_AUTH_STRING"]
    stored = {"kind": "Secret", "metadata": {"name": "prefect-auth"}, "stringData": {"auth-string": "admin:pass"}}
    assert auth_problems([stored, one("Deployment")]) == ["Secret prefect-auth holds auth-string"]


# The Secrets the pods read, each created by hand (never in a manifest): the Prefect credential and the pipeline's keys.
HAND_MADE = {"prefect-auth", "eagle3-keys"}


def secret_refs(doc: dict) -> list[tuple[str, str, str | None, bool]]:
    """(where, Secret name, key or None for a whole Secret, optional) for every Secret a pod of ``doc`` reads."""
    if doc["kind"] == "RayCluster":
        pods = [(f"RayCluster {group}", t["spec"]) for group, t in pod_templates(doc)]
    elif doc["kind"] == "Deployment":
        pods = [(f"Deployment {doc['metadata']['name']}", doc["spec"]["template"]["spec"])]
    else:
        return []
    refs = []
    for where, pod in pods:
        for c in pod["containers"]:
            for source in c.get("envFrom", []):
                if "secretRef" in source:
                    ref = source["secretRef"]
                    refs.append((where, ref["name"], None, bool(ref.get("optional"))))
            for e in c.get("env", []):
                if ref := e.get("valueFrom", {}).get("secretKeyRef"):
                    refs.append((where, ref["name"], ref["key"], bool(ref.get("optional"))))
        for v in pod.get("volumes", []):
            if "secret" in v:
                refs.append((where, v["secret"]["secretName"], None, bool(v["secret"].get("optional"))))
    return refs


def secret_problems(docs: list[dict]) -> list[str]:
    """Where the manifests break the rule for credentials: no manifest holds a Secret (a placeholder
    value applied as is becomes the credential), every Secret a pod reads is one created by hand, and a
    Ray pod reads only the Hugging Face token (a whole Secret would reach every Ray worker process; the
    vLLM key reaches generation on the cluster as a call argument)."""
    problems = [f"Secret {d['metadata']['name']}: a Secret in the manifests" for d in docs if d["kind"] == "Secret"]
    for doc in docs:
        for where, name, key, optional in secret_refs(doc):
            if name not in HAND_MADE:
                problems.append(f"{where}: reads the Secret {name}, which nobody is told to create")
            if name == "eagle3-keys" and not optional:
                problems.append(f"{where}: eagle3-keys holds only the keys a user needs; its reference is optional")
            if where.startswith("RayCluster") and (name, key) != ("eagle3-keys", "HF_TOKEN"):
                problems.append(f"{where}: a Ray pod reads {name}{f'/{key}' if key else ' whole'}")
    return problems


def test_no_manifest_holds_a_secret_and_the_pods_read_the_hand_made_ones():
    docs = [doc for _, doc in manifests()]
    assert secret_problems(docs) == []
    refs = {(where, name, key) for doc in docs for where, name, key, _ in secret_refs(doc)}
    assert ("Deployment eagle3-prefect-worker", "eagle3-keys", None) in refs
    assert ("RayCluster gpu", "eagle3-keys", "HF_TOKEN") in refs
    # How to create each is written where a user looks, from a file (a value on kubectl's command line is in `ps`).
    texts = {
        "docs/prefect.md": (ROOT / "docs" / "prefect.md").read_text(),
        "kustomization.yaml": (K8S / "kustomization.yaml").read_text(),
    }
    for name in HAND_MADE:
        for where, text in texts.items():
            assert re.search(rf"kubectl -n \S+ create secret generic {name} --from-file=", text), (where, name)
    for path in [*K8S.glob("*.yaml"), ROOT / "docs" / "prefect.md"]:
        literal = re.search(r"create secret generic [^`\n]*--from-literal", path.read_text())
        assert literal is None, f"{path.name}: a value on kubectl's command line"
    # The check bites: the placeholder Secret back, a Ray pod reading the whole Secret, a required eagle3-keys.
    placeholder = {"kind": "Secret", "metadata": {"name": "eagle3-keys"}, "stringData": {"EAGLE3_API_KEY": "x"}}
    assert secret_problems([placeholder]) == ["Secret eagle3-keys: a Secret in the manifests"]

    def whole(d):
        d["spec"]["workerGroupSpecs"][0]["template"]["spec"]["containers"][0]["envFrom"] = [
            {"secretRef": {"name": "eagle3-keys", "optional": True}}
        ]

    assert secret_problems([mutated("RayCluster", whole)]) == ["RayCluster gpu: a Ray pod reads eagle3-keys whole"]

    def required(d):
        d["spec"]["template"]["spec"]["containers"][0]["envFrom"][1]["secretRef"].pop("optional")

    assert secret_problems([mutated("Deployment", required)]) == [
        "Deployment eagle3-prefect-worker: eagle3-keys holds only the keys a user needs; its reference is optional"
    ]


def mutated(kind: str, change) -> dict:
    doc = copy.deepcopy(one(kind))
    change(doc)
    return doc


@pytest.mark.parametrize(
    "kind, change, expected",
    [
        ("RayCluster", lambda d: d["spec"]["workerGroupSpecs"][0].pop("minReplicas"), "'minReplicas' is a required"),
        ("RayCluster", lambda d: d["spec"].pop("headGroupSpec"), "'headGroupSpec' is a required"),
        (
            "RayCluster",
            lambda d: d["spec"]["headGroupSpec"]["rayStartParams"].update({"num-gpus": 0}),
            "not of type 'string'",
        ),
        ("RayCluster", lambda d: d["spec"]["workerGroupSpecs"][0].update({"replica": 2}), "'replica' was unexpected"),
        (
            "RayCluster",
            lambda d: d["spec"]["workerGroupSpecs"][0].update({"maxReplicas": "4"}),
            "not of type 'integer'",
        ),
        (
            "RayCluster",
            lambda d: d["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0].update(
                {"volumeMount": d["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0].pop("volumeMounts")}
            ),
            "volumeMount",
        ),
        (
            "RayCluster",
            lambda d: d["spec"]["workerGroupSpecs"][0]["template"]["spec"]["volumes"][0].update(
                {"persistentVolumeClaim": {}}
            ),
            "claimName",
        ),
        ("Deployment", lambda d: d["spec"].pop("selector"), "'selector' is a required"),
        ("Deployment", lambda d: d["spec"].update({"replicas": "1"}), "not of type 'integer'"),
        ("PersistentVolumeClaim", lambda d: d["spec"].update({"accesModes": ["ReadWriteMany"]}), "accesModes"),
        ("ConfigMap", lambda d: d["data"].update({"PORT": 8080}), "not of type 'string'"),
    ],
    ids=[
        "raycluster-missing-minReplicas",
        "raycluster-missing-headGroupSpec",
        "raycluster-rayStartParams-int",
        "raycluster-misspelt-replicas",
        "raycluster-maxReplicas-string",
        "raycluster-pod-misspelt-volumeMounts",
        "raycluster-pod-pvc-without-claimName",
        "deployment-missing-selector",
        "deployment-replicas-string",
        "pvc-misspelt-accessModes",
        "configmap-int-value",
    ],
)
def test_a_broken_manifest_fails_validation(kind, change, expected):
    if kind == "PersistentVolumeClaim":
        doc = copy.deepcopy(by_kind(kind)[0])
        change(doc)
    else:
        doc = mutated(kind, change)
    with pytest.raises(jsonschema.ValidationError) as caught:
        validate(doc)
    assert expected in str(caught.value), str(caught.value)[:400]
