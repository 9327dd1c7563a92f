"""k8s/*.yaml are resources KubeRay v1.7.0 accepts as written, and keep the project's promises.

Offline, no Kubernetes: every manifest is validated against the CRD schemas pinned in
``../shared/kuberay/v1.7.0`` (skipped, with the reason, where they are absent), and every field
the schema does not declare is refused, because the API server would silently prune it (a
misspelled ``shutdownAfterJobFinish`` is lost, and the cluster outlives the job). A planted
misspelling in a copy of each manifest is shown to fail. Beyond the schemas: the RayJob's
entrypoint parses with fit's own parser, the RayService's ``serveConfigV2`` passes Ray Serve's
``ServeDeploySchema`` and is what ``serve --write-config`` writes, the images carry the Ray that
pyproject.toml pins, and docs/kubernetes.md's commands parse with the real parsers.
"""

from __future__ import annotations

import importlib.metadata
import inspect
import re
import shlex

import pytest
import yaml

from raytrain_mnist.__main__ import load_command
from tests.conftest import REPO, run_cli_here
from tests.test_readme import _slug, package_commands, parse

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: pytest's own dependency
    import tomli as tomllib

K8S = REPO / "k8s"
KUBERAY = REPO.parent / "shared" / "kuberay" / "v1.7.0"
DOC = REPO / "docs" / "kubernetes.md"
DOCKERFILE = K8S / "Dockerfile"
#: The training service's RayJob, on the standing cluster (no cluster spec of its own).
SERVICE_JOB = K8S / "rayjob-service.yaml"
#: A search through that service, on the same cluster.
SEARCH_JOB = K8S / "rayjob-tune-service.yaml"
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())

#: kind -> (manifest, the CRD file that defines the kind)
MANIFESTS = {
    "RayCluster": (K8S / "raycluster.yaml", "ray.io_rayclusters.yaml"),
    "RayJob": (K8S / "rayjob-fit.yaml", "ray.io_rayjobs.yaml"),
    "RayService": (K8S / "rayservice.yaml", "ray.io_rayservices.yaml"),
}
#: The ObjectMeta fields a manifest may set (the root ``metadata``, which the CRD schema leaves
#: to the API server).
OBJECT_META = {"name", "namespace", "labels", "annotations"}
#: KubeRay's limit on a RayJob's and a RayService's name (MaxRayClusterNameLength - 6).
MAX_NAME = 47
#: The Ray token's Secret, and the key KubeRay reads it from.
TOKEN_KEY = "auth_token"
#: Our image: ``<registry>/raytrain-mnist:<package version>-ray<Ray version>``.
IMAGE = re.compile(
    r"^(?P<repo>[^:@\s]+/raytrain-mnist):(?P<pkg>[^-\s]+)-ray(?P<ray>\d+\.\d+\.\d+)$"
)


# --------------------------------------------------------------------------- validation


def _strip_extensions(node):
    """The schema without Kubernetes' ``x-kubernetes-*`` extensions, for jsonschema."""
    if isinstance(node, dict):
        return {
            k: _strip_extensions(v) for k, v in node.items() if not k.startswith("x-kubernetes-")
        }
    if isinstance(node, list):
        return [_strip_extensions(v) for v in node]
    return node


def undeclared(value, schema: dict, path: str = "") -> list[str]:
    """The paths in ``value`` that a structural schema would prune: a key of an object whose
    schema neither lists it in ``properties`` nor allows more (``additionalProperties``,
    ``x-kubernetes-preserve-unknown-fields``). An object schema with neither lists nor
    allows any key (Kubernetes prunes everything in it)."""
    found: list[str] = []
    if isinstance(value, dict):
        props = schema.get("properties") or {}
        extra = schema.get("additionalProperties")
        keep = schema.get("x-kubernetes-preserve-unknown-fields") is True
        for key, item in value.items():
            where = f"{path}.{key}" if path else str(key)
            if key in props:
                found += undeclared(item, props[key], where)
            elif isinstance(extra, dict):
                found += undeclared(item, extra, where)
            elif not (extra is True or keep):
                found.append(where)
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        for i, item in enumerate(value):
            found += undeclared(item, schema["items"], f"{path}[{i}]")
    return found


def problems(manifest: dict, crd: dict) -> list[str]:
    """Everything the API server would refuse or silently drop in ``manifest``, one line each."""
    import jsonschema

    (version,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    schema = version["schema"]["openAPIV3Schema"]
    kind = crd["spec"]["names"]["kind"]
    found = []
    if manifest.get("apiVersion") != f"{crd['spec']['group']}/v1":
        found.append(f"apiVersion: {manifest.get('apiVersion')!r}, not 'ray.io/v1'")
    if manifest.get("kind") != kind:
        found.append(f"kind: {manifest.get('kind')!r}, not {kind!r}")
    meta = manifest.get("metadata") or {}
    found += [f"metadata.{key}: not an ObjectMeta field" for key in sorted(set(meta) - OBJECT_META)]
    name = str(meta.get("name", ""))
    if not re.fullmatch(r"[a-z]([-a-z0-9]*[a-z0-9])?", name) or len(name) > MAX_NAME:
        found.append(f"metadata.name: {name!r} is not a DNS-1035 label of at most {MAX_NAME}")
    validator = jsonschema.Draft4Validator(_strip_extensions(schema))
    for error in validator.iter_errors(manifest):
        where = ".".join(str(p) for p in error.absolute_path) or "(root)"
        found.append(f"{where}: {error.message}")
    body = {k: v for k, v in manifest.items() if k != "metadata"}
    found += [f"{where}: not in the {kind} schema" for where in undeclared(body, schema)]
    return found


@pytest.fixture(scope="module")
def crds() -> dict[str, dict]:
    if not KUBERAY.is_dir():
        pytest.skip(
            f"KubeRay v1.7.0 CRD schemas not found at {KUBERAY} "
            "(../shared/kuberay beside the checkout; its README says what they are)"
        )
    # libyaml's loader where PyYAML has it: the three CRDs are 61,000 lines.
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    return {
        kind: yaml.load((KUBERAY / crd).read_text(), Loader=loader)
        for kind, (_, crd) in MANIFESTS.items()
    }


def load(kind: str) -> dict:
    return yaml.safe_load(MANIFESTS[kind][0].read_text())


def cluster_spec(kind: str) -> dict:
    """The RayCluster spec a manifest describes (its own, or the one it has KubeRay create)."""
    spec = load(kind)["spec"]
    if kind == "RayJob":
        return spec["rayClusterSpec"]
    if kind == "RayService":
        return spec["rayClusterConfig"]
    return spec


def pod_specs(spec: dict) -> dict[str, dict]:
    """group name (``head`` for the head) -> pod spec."""
    groups = {"head": spec["headGroupSpec"]["template"]["spec"]}
    for group in spec.get("workerGroupSpecs") or []:
        groups[group["groupName"]] = group["template"]["spec"]
    return groups


def containers(spec: dict) -> list[dict]:
    return [
        c
        for pod in pod_specs(spec).values()
        for c in (pod.get("initContainers") or []) + pod["containers"]
    ]


def gpus(container: dict) -> int:
    return int((container.get("resources") or {}).get("limits", {}).get("nvidia.com/gpu", 0))


def cpus(container: dict) -> float:
    value = str((container.get("resources") or {}).get("limits", {}).get("cpu", "0"))
    return int(value[:-1]) / 1000 if value.endswith("m") else float(value)


# --------------------------------------------------------------------------- the schemas


@pytest.mark.parametrize("kind", MANIFESTS)
def test_manifest_is_valid_for_kuberay_and_declares_every_field(kind, crds):
    assert problems(load(kind), crds[kind]) == []


#: (manifest, a line of it, the line misspelled or mistyped, what the check must name)
PLANTED = [
    ("RayJob", "  shutdownAfterJobFinishes: true", "  shutdownAfterJobFinish: true",
     "spec.shutdownAfterJobFinish: not in the RayJob schema"),
    ("RayCluster", "      rayStartParams: {}", "      rayStartParam: {}",
     "spec.workerGroupSpecs.0.rayStartParam: not in the RayCluster schema"),
    ("RayJob", "            tolerations:", "            toleration:",
     "spec.rayClusterSpec.workerGroupSpecs.0.template.spec.toleration: not in the RayJob schema"),
    ("RayService", "            automountServiceAccountToken: false",
     "            automountServiceAccountTokens: false",
     "spec.rayClusterConfig.workerGroupSpecs.0.template.spec.automountServiceAccountTokens"),
    ("RayCluster", "      maxReplicas: 4", "      maxReplicas: four",
     "spec.workerGroupSpecs.0.maxReplicas: 'four' is not of type 'integer'"),
]  # fmt: skip


@pytest.mark.parametrize(("kind", "line", "planted", "named"), PLANTED)
def test_a_planted_mistake_in_a_copy_fails_and_is_named(kind, line, planted, named, crds, tmp_path):
    text = MANIFESTS[kind][0].read_text()
    assert len(re.findall(rf"^{re.escape(line)}$", text, re.M)) == 1, f"no single {line!r}"
    copy_path = tmp_path / MANIFESTS[kind][0].name
    copy_path.write_text(re.sub(rf"^{re.escape(line)}$", planted, text, flags=re.M))
    found = problems(yaml.safe_load(copy_path.read_text()), crds[kind])
    normalised = [p.replace("[", ".").replace("]", "") for p in found]
    assert any(p.startswith(named) for p in normalised), found
    assert len(found) == 1, f"only the planted mistake is reported: {found}"


# --------------------------------------------------------------------------- the cluster


@pytest.mark.parametrize("kind", MANIFESTS)
def test_token_auth_is_the_operators_with_one_secret(kind):
    """KubeRay's own field: the operator injects RAY_AUTH_MODE=token and RAY_AUTH_TOKEN (from
    the Secret's ``auth_token``) into every Ray container, the autoscaler and the submitter,
    and sends the token itself; a container that set either variable would override it."""
    spec = cluster_spec(kind)
    assert spec["authOptions"] == {"mode": "token", "secretName": "raytrain-mnist-ray-token"}
    for container in containers(spec):
        names = {e["name"] for e in container.get("env") or []}
        assert not names & {"RAY_AUTH_MODE", "RAY_AUTH_TOKEN"}, container["name"]
    secret = spec["authOptions"]["secretName"]
    assert f"kubectl create secret generic {secret} --from-file={TOKEN_KEY}=" in DOC.read_text()


@pytest.mark.parametrize("kind", MANIFESTS)
def test_a_head_that_serves_ray_client_has_grpc_fork_handlers_off(kind):
    """Its Ray Client proxy forks each driver's server while its gRPC threads run; with
    gRPC's fork handlers on, that server now and then dies as it starts (ray-project/ray#63202)."""
    from raytrain_mnist.driver.cluster import CLIENT_HEAD_ENV

    [head] = pod_specs(cluster_spec(kind))["head"]["containers"]
    assert 10001 in {port["containerPort"] for port in head["ports"]}
    env = {e["name"]: e.get("value") for e in head.get("env") or []}
    assert CLIENT_HEAD_ENV.items() <= env.items(), env


@pytest.mark.parametrize("kind", MANIFESTS)
def test_head_hosts_no_training_worker_nor_replica_and_is_not_exposed(kind):
    spec = cluster_spec(kind)
    head = spec["headGroupSpec"]
    assert head["rayStartParams"]["num-cpus"] == "0"
    assert all(gpus(c) == 0 for c in pod_specs(spec)["head"]["containers"])
    assert head.get("serviceType", "ClusterIP") == "ClusterIP"
    assert not head.get("enableIngress")
    assert spec["enableInTreeAutoscaling"] is True


#: What every container must say of itself (and the autoscaler sidecar KubeRay adds).
LOCKED_DOWN = {
    "runAsNonRoot": True,
    "allowPrivilegeEscalation": False,
    "capabilities": {"drop": ["ALL"]},
    "seccompProfile": {"type": "RuntimeDefault"},
}


def insecure(spec: dict) -> list[str]:
    """What a RayCluster spec lets a pod do that it must not: a container that may become
    root, gain privileges or keep capabilities, or runs without the runtime's seccomp filter;
    a writable image, or a read-only one without an emptyDir at /tmp (where Ray writes); a
    worker pod with a Kubernetes API token (only the head's autoscaler uses one)."""
    found = []
    sidecar = (spec.get("autoscalerOptions") or {}).get("securityContext") or {}
    found += [f"autoscaler: {k}" for k, v in LOCKED_DOWN.items() if sidecar.get(k) != v]
    for group, pod in pod_specs(spec).items():
        scratch = {
            v["name"]
            for v in pod.get("volumes") or []
            if "emptyDir" in v and v["emptyDir"].get("medium") != "Memory"
        }
        if group != "head" and pod.get("automountServiceAccountToken") is not False:
            found.append(f"{group}: a service-account token it needs none of")
        for container in (pod.get("initContainers") or []) + pod["containers"]:
            name = f"{group}/{container['name']}"
            context = container.get("securityContext") or {}
            found += [f"{name}: {k}" for k, v in LOCKED_DOWN.items() if context.get(k) != v]
            if context.get("runAsUser") in (None, 0):
                found.append(f"{name}: runAsUser (the image's user ray is no number)")
            if context.get("readOnlyRootFilesystem") is not True:
                found.append(f"{name}: readOnlyRootFilesystem")
            mounts = {m["mountPath"]: m["name"] for m in container.get("volumeMounts") or []}
            if mounts.get("/tmp") not in scratch:
                found.append(f"{name}: no emptyDir at /tmp for Ray")
    return found


@pytest.mark.parametrize("kind", MANIFESTS)
def test_no_pod_can_become_root_or_write_its_image(kind):
    assert insecure(cluster_spec(kind)) == []


@pytest.mark.parametrize(
    ("line", "named"),
    [
        ("runAsNonRoot: true", "runAsNonRoot"),
        ("allowPrivilegeEscalation: false", "allowPrivilegeEscalation"),
        ('drop: ["ALL"]', "capabilities"),
        ("type: RuntimeDefault", "seccompProfile"),
        ("readOnlyRootFilesystem: true", "readOnlyRootFilesystem"),
        ("mountPath: /tmp", "no emptyDir at /tmp"),
    ],
)
def test_a_manifest_without_them_is_refused(line, named):
    """Each setting removed from the first container that has it: named."""
    text = MANIFESTS["RayService"][0].read_text()
    lines = text.splitlines()
    (first, *_) = [i for i, item in enumerate(lines) if item.strip() == line]
    # A mapping's last key goes with the key that holds it (the mount's name, seccompProfile,
    # capabilities); a plain setting alone.
    pair = line in ("mountPath: /tmp", "type: RuntimeDefault") or line.startswith("drop")
    del lines[first - 1 if pair else first : first + 1]
    spec = yaml.safe_load("\n".join(lines))["spec"]["rayClusterConfig"]
    found = insecure(spec)
    assert any(named in problem for problem in found), found


def test_serve_proxies_bound_every_connection():
    """The RayService's Serve proxies run serve's HTTP bounds (docs/serve.md): every
    container that may host one carries the proxy callback."""
    for container in containers(cluster_spec("RayService")):
        env = {e["name"]: e.get("value") for e in container.get("env") or []}
        assert env.get("RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH") == (
            "raytrain_mnist.serving.http:proxy_callback"
        ), container["name"]


def test_gpu_workers_scale_from_zero_to_four_onto_tainted_gpu_nodes():
    spec = cluster_spec("RayCluster")
    groups = [
        g
        for g in spec["workerGroupSpecs"]
        if any(gpus(c) for c in g["template"]["spec"]["containers"])
    ]
    assert groups, "no GPU worker group"
    for group in groups:
        assert group["minReplicas"] == 0 and group.get("replicas", 0) == 0
        pod = group["template"]["spec"]
        (ray,) = [c for c in pod["containers"] if gpus(c)]
        assert gpus(ray) == 1 and ray["resources"]["requests"]["nvidia.com/gpu"] == 1
        assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod[
            "tolerations"
        ]
        assert pod["automountServiceAccountToken"] is False
    assert sum(g["maxReplicas"] for g in groups) >= 4


def test_images_carry_the_pinned_ray_and_python():
    """Every container runs our image, built FROM Ray's image at the Ray pyproject.toml pins
    (the Ray this suite runs) and a Python that requires-python allows; rayVersion says it."""
    from packaging.requirements import Requirement
    from packaging.specifiers import SpecifierSet

    project = PYPROJECT["project"]
    (ray_pin,) = [Requirement(r) for r in project["dependencies"] if Requirement(r).name == "ray"]
    installed = importlib.metadata.version("ray")
    base = re.search(r"^FROM rayproject/ray:(\S+?)@", DOCKERFILE.read_text(), re.M)
    assert base, "k8s/Dockerfile is not FROM rayproject/ray:TAG@DIGEST"
    tag = re.fullmatch(r"(\d+\.\d+\.\d+)-py(\d)(\d+)-gpu", base.group(1))
    assert tag, base.group(1)
    ray_version, python = tag.group(1), f"{tag.group(2)}.{tag.group(3)}"
    assert ray_version in ray_pin.specifier and ray_version == installed
    assert python in SpecifierSet(project["requires-python"])
    for kind, (path, _) in MANIFESTS.items():
        spec = cluster_spec(kind)
        assert spec["rayVersion"] == ray_version, path.name
        for container in containers(spec):
            image = IMAGE.fullmatch(container["image"])
            assert image, f"{path.name}: {container['image']} is not our image"
            assert (image["pkg"], image["ray"]) == (project["version"], ray_version)
            assert f"-t {container['image']} " in DOCKERFILE.read_text()


def test_the_base_image_is_taken_by_digest_or_the_build_stops():
    """A tag can be re-pushed to name another image, a digest cannot: whatever the build
    arguments, the Dockerfile's FROM names the base by digest (the ARG's default, where one is
    pinned, or --build-arg BASE_DIGEST), or the build stops there, naming BASE_DIGEST. Its
    FROM line is expanded as BuildKit expands it (frontend/dockerfile/shell/lex.go)."""
    text = DOCKERFILE.read_text()
    digest = "sha256:" + "0123456789abcdef" * 4
    base = re.search(r"^FROM (rayproject/ray:[^@\s]+)@", text, re.M)
    assert base, "k8s/Dockerfile is not FROM rayproject/ray:TAG@DIGEST"
    (pinned,) = re.findall(r"^ARG BASE_DIGEST(?:=(.*))?$", text, re.M)
    assert pinned == "" or re.fullmatch(r"sha256:[0-9a-f]{64}", pinned), pinned
    for build_args in ({}, {"BASE_DIGEST": ""}):
        if pinned and not build_args:
            assert _base_image(text, build_args).endswith(f"@{pinned}")
        else:
            with pytest.raises(ValueError, match="BASE_DIGEST: is not allowed to be"):
                _base_image(text, build_args)
    given = _base_image(text, {"BASE_DIGEST": digest})
    assert given == f"{base[1]}@{digest}", given
    # How to read the digest and move the pin: in the file, and next to the build in the docs.
    assert f"imagetools inspect {base[1]}" in text and f"crane digest {base[1]}" in text
    doc = DOC.read_text()
    assert f"imagetools inspect {base[1]}" in doc and "ARG BASE_DIGEST=sha256:" in doc


def _base_image(dockerfile: str, build_args: dict[str, str]) -> str:
    """The image the (one) FROM line names, its ARGs set from ``build_args`` or their
    defaults: BuildKit's ``${NAME}``, ``${NAME:-word}``, ``${NAME:+word}`` and ``${NAME:?}``
    (ValueError, in BuildKit's words, where that stops the build)."""
    head, _, rest = dockerfile.partition("\nFROM ")
    env = {}
    for name, default in re.findall(r"^ARG (\w+)(?:=(.*))?$", head, re.M):
        env[name] = build_args.get(name, default)  # an ARG without a value: empty

    def expand(found: re.Match) -> str:
        name, modifier, word = found.groups()
        value = env.get(name, "")
        if modifier == ":-":
            return value or word
        if modifier == ":+":
            return word if value else ""
        if modifier == ":?" and not value:
            raise ValueError(f"{name}: {word or 'is not allowed to be empty'}")
        return value

    line = rest.partition("\n")[0]
    assert re.fullmatch(r"[^$]*(\$\{\w+(:[-+?][^}]*)?\}[^$]*)*", line), line
    return re.sub(r"\$\{(\w+)(?:(:[-+?])([^}]*))?\}", expand, line)


def test_dockerfile_installs_from_the_package_files_only():
    text = DOCKERFILE.read_text()
    sources = [
        word
        for line in re.findall(r"^COPY (.+)$", text, re.M)
        for word in shlex.split(line)[:-1]
        if not word.startswith("--")
    ]
    assert set(sources) == {"pyproject.toml", PYPROJECT["project"]["readme"], "raytrain_mnist"}
    assert all((REPO / s).exists() for s in sources)
    (extras,) = re.findall(r"^RUN pip install --no-cache-dir '\.\[(.+)\]' ", text, re.M)
    assert set(extras.split(",")) <= set(PYPROJECT["project"]["optional-dependencies"])
    assert "s3" in extras.split(",")  # its pods hold their runs' S3 leases with boto3
    # The MNIST download it bakes in calls the package's own loader, as it is today.
    (code,) = re.findall(r'^RUN python -c "(.+)"$', text, re.M)
    match = re.fullmatch(r"from (\S+) import (\w+); \2\(dataset='mnist'\)", code)
    assert match, code
    loader = getattr(importlib.import_module(match[1]), match[2])
    inspect.signature(loader).bind(dataset="mnist")


def test_names_and_services_do_not_collide():
    names = [load(kind)["metadata"]["name"] for kind in MANIFESTS]
    assert len(set(names)) == len(names)
    # KubeRay names each head Service NAME-head-svc and a RayService's NAME-serve-svc.
    text = DOC.read_text()
    assert f"svc/{names[0]}-head-svc" in text
    assert f"svc/{load('RayService')['metadata']['name']}-serve-svc" in text


# --------------------------------------------------------------------------- the job


def _placeable_workers(
    spec: dict, per_worker_cpus: float, per_worker_gpus: float, driver: float
) -> int:
    """How many Train workers the cluster can hold at its largest, the driver on one pod."""
    slots = []
    for group in spec["workerGroupSpecs"]:
        ray = group["template"]["spec"]["containers"][0]  # KubeRay's Ray container
        slots += [[cpus(ray), gpus(ray)] for _ in range(group["maxReplicas"])]
    if driver:
        slot = next(s for s in slots if s[0] >= driver)
        slot[0] -= driver
    return sum(
        int(min(c // per_worker_cpus, g // per_worker_gpus if per_worker_gpus else c))
        for c, g in slots
    )


def test_rayjob_runs_fit_on_its_own_cluster_and_cleans_up():
    job = load("RayJob")["spec"]
    assert job["shutdownAfterJobFinishes"] is True
    assert job["ttlSecondsAfterFinished"] > 0
    assert job["activeDeadlineSeconds"] > 0
    assert job["backoffLimit"] >= 1
    # KubeRay refuses backoffLimit with clusterSelector: the job brings its cluster, which is
    # k8s/raycluster.yaml's (one cluster description, not two that drift apart).
    assert "clusterSelector" not in job
    assert job["rayClusterSpec"] == load("RayCluster")["spec"]

    words = shlex.split(job["entrypoint"])
    assert words[:3] == ["python", "-m", "raytrain_mnist.fit"], job["entrypoint"]
    cfg = load_command("fit").parse(words[3:])
    run = cfg.run.scaling
    assert (run.num_workers, run.use_gpu) == (4, True)
    assert cfg.run.storage.storage_path.startswith("s3://")
    assert cfg.run.data.dataset == "mnist"
    # The driver takes a CPU, which the head lacks: it runs on a worker pod, and the four
    # workers (1 CPU on a cluster, 1 GPU each) still fit beside it.
    driver = job["entrypointNumCpus"]
    assert (
        driver >= 1 and job["rayClusterSpec"]["headGroupSpec"]["rayStartParams"]["num-cpus"] == "0"
    )
    room = _placeable_workers(job["rayClusterSpec"], run.cpus_per_worker or 1, run.gpus, driver)
    assert room >= run.max_workers


def test_the_training_service_job_runs_on_the_standing_cluster(crds):
    """k8s/rayjob-service.yaml: a RayJob on k8s/raycluster.yaml's cluster (clusterSelector)
    whose entrypoint the service command's own parser takes: four GPU workers, full MNIST,
    the runs in the bucket."""
    job = yaml.safe_load(SERVICE_JOB.read_text())
    assert problems(job, crds["RayJob"]) == []
    spec = job["spec"]
    cluster = load("RayCluster")["metadata"]["name"]
    assert spec["clusterSelector"] == {"ray.io/cluster": cluster}
    assert "rayClusterSpec" not in spec and "backoffLimit" not in spec
    words = shlex.split(spec["entrypoint"])
    assert words[:4] == ["python", "-m", "raytrain_mnist.service", "start"], words
    options = load_command("service").parse(words[3:])
    scaling = options.run.scaling
    assert (options.name, scaling.num_workers, scaling.use_gpu) == ("mnist", 4, True)
    assert options.run.data.dataset == "mnist" and options.roots == ()
    assert options.run.storage.storage_path.startswith("s3://")
    assert len(job["metadata"]["name"]) <= MAX_NAME


def test_the_search_through_the_service_runs_on_the_standing_cluster(crds):
    """k8s/rayjob-tune-service.yaml: a RayJob on the same cluster as the service, whose
    entrypoint the tune command's own parser takes: a search through service `mnist` under
    its storage root, named (applied again, it resumes)."""
    job = yaml.safe_load(SEARCH_JOB.read_text())
    assert problems(job, crds["RayJob"]) == []
    spec, service = job["spec"], yaml.safe_load(SERVICE_JOB.read_text())["spec"]
    assert spec["clusterSelector"] == service["clusterSelector"]
    assert "rayClusterSpec" not in spec and "backoffLimit" not in spec
    assert spec["entrypointNumCpus"] >= 1  # on a worker pod, not the head's
    words = shlex.split(spec["entrypoint"])
    assert words[:3] == ["python", "-m", "raytrain_mnist.tune"], words
    cmd = load_command("tune").parse(words[3:])
    served = load_command("service").parse(shlex.split(service["entrypoint"])[3:])
    assert cmd.run.scaling.service == served.name and cmd.auto_workers
    assert cmd.run.storage.storage_path == served.run.storage.storage_path
    assert cmd.run.storage.name and cmd.settings.scheduler == "asha"
    assert len(job["metadata"]["name"]) <= MAX_NAME


# --------------------------------------------------------------------------- the service


def _serve_command() -> tuple[str, list[str]]:
    """The ``serve --write-config`` command rayservice.yaml says it was written by."""
    match = re.search(
        r"^#\s+raytrain-mnist serve (\S+) (.*?) --write-config \S+$",
        MANIFESTS["RayService"][0].read_text(),
        re.M,
    )
    assert match, "rayservice.yaml does not name the serve --write-config command"
    return match[1], shlex.split(match[2])


def test_serve_config_is_what_write_config_writes(tmp_path):
    """serveConfigV2 passes Serve's own schema and equals what `serve --write-config` writes
    with the flags the manifest names, the checkpoint aside (the run's, in the bucket)."""
    from ray.serve.schema import ServeDeploySchema

    from raytrain_mnist.nn import checkpoint as ckpt
    from raytrain_mnist.nn.model import ConvNet

    manifest = yaml.safe_load(load("RayService")["spec"]["serveConfigV2"])
    ServeDeploySchema.model_validate(manifest)

    target, flags = _serve_command()
    local = tmp_path / "checkpoint_000000"
    local.mkdir()
    ckpt.save(local, {"model": ConvNet().state_dict(), "epoch": 0})
    out = tmp_path / "serve_config.yaml"
    result = run_cli_here("serve", str(local), *flags, "--write-config", str(out))
    assert result.returncode == 0, result.stderr
    written = yaml.safe_load(out.read_text())

    (app,) = manifest["applications"]
    checkpoint = app["args"]["checkpoint"]
    assert checkpoint.startswith(target.rstrip("/") + "/") and checkpoint.startswith("s3://")
    app["args"]["checkpoint"] = written["applications"][0]["args"]["checkpoint"]
    assert manifest == written
    # The module and function it names build the application (as Serve will, on the cluster).
    module, _, attr = app["import_path"].partition(":")
    assert callable(getattr(importlib.import_module(module), attr))


def test_service_routes_to_the_proxy_and_has_room_for_the_replicas():
    spec = load("RayService")["spec"]
    config = yaml.safe_load(spec["serveConfigV2"])
    assert config["http_options"]["host"] == "0.0.0.0"  # the serve Service reaches pods' IPs
    cluster = spec["rayClusterConfig"]
    head = pod_specs(cluster)["head"]["containers"][0]
    ports = {p["name"]: p["containerPort"] for p in head["ports"]}
    assert ports["serve"] == config["http_options"]["port"]
    (app,) = config["applications"]
    assert not app["args"]["use_gpu"]
    room = _placeable_workers(cluster, 1, 0, 0)  # a replica takes 1 CPU
    assert room >= app["args"]["replicas"]


# --------------------------------------------------------------------------- the guide


def test_guide_commands_parse_and_links_lead_somewhere():
    found = package_commands(DOC)
    assert {c for c, _, _ in found} >= {"submit", "serve"}
    for command, args, line in found:
        try:
            parse(command, args)
        except SystemExit as exc:
            assert exc.code in (0, None), line
    text = DOC.read_text()
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+:", target):
            continue
        path, _, anchor = target.partition("#")
        file = (DOC.parent / path).resolve() if path else DOC
        assert file.exists(), target
        if anchor and file.suffix == ".md":
            assert anchor in {_slug(h) for h in re.findall(r"^#+ (.+)$", file.read_text(), re.M)}
    for path, _ in MANIFESTS.values():
        assert f"kubectl apply -f k8s/{path.name}" in text
    # The guide writes the config with the flags the manifest's serveConfigV2 was written with.
    _, flags = _serve_command()
    written = [
        args[1 : args.index("--write-config")] + args[args.index("--write-config") + 2 :]
        for command, args, _ in found
        if command == "serve" and "--write-config" in args
    ]
    assert flags in written, (
        f"docs/kubernetes.md: no `serve RUN {shlex.join(flags)} --write-config`"
    )


def test_the_manifests_are_what_the_guide_applies():
    """Nothing in k8s/ that the guide and this file do not cover."""
    files = {p.name for p in K8S.iterdir()}
    jobs = {DOCKERFILE.name, SERVICE_JOB.name, SEARCH_JOB.name}
    assert files == {p.name for p, _ in MANIFESTS.values()} | jobs
    assert f"kubectl apply -f k8s/{SERVICE_JOB.name}" in DOC.read_text()
    assert f"kubectl apply -f k8s/{SEARCH_JOB.name}" in (REPO / "docs" / "service.md").read_text()
