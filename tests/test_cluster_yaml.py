"""cluster.yaml and cluster-onprem.yaml are valid for `ray up` and keep their promises; offline,
no cloud calls. The two share their file mounts, setup and start commands word for word
(tests/test_ray_up.py runs the on-prem one for real)."""

from __future__ import annotations

import copy
import re

import pytest
import yaml

from .conftest import REPO

CLUSTER_YAML = REPO / "cluster.yaml"
ONPREM_YAML = REPO / "cluster-onprem.yaml"
#: What both cluster files do alike on every node: what is synced (and left out), how each
#: node is set up, how Ray starts. Only the provider, the node types, auth, sizes and the
#: per-kind setup (the storage path, boto3 for the AWS autoscaler) differ.
SHARED_KEYS = (
    "file_mounts",
    "cluster_synced_files",
    "file_mounts_sync_continuously",
    "rsync_exclude",
    "rsync_filter",
    "initialization_commands",
    "setup_commands",
    "head_start_ray_commands",
    "worker_start_ray_commands",
)


@pytest.fixture(scope="module")
def raw() -> dict:
    return yaml.safe_load(CLUSTER_YAML.read_text())


@pytest.fixture(scope="module")
def config(raw) -> dict:
    """What `ray up` would use: Ray's own defaults filled in, then Ray's schema check."""
    from ray.autoscaler._private.util import prepare_config, validate_config

    prepared = prepare_config(copy.deepcopy(raw))
    validate_config(prepared)
    return prepared


def _commands(config: dict, key: str) -> str:
    return "\n".join(config.get(key) or [])


def test_gpu_workers_scale_from_zero_to_four(config):
    types = config["available_node_types"]
    gpu_types = {
        name: t
        for name, t in types.items()
        if name != config["head_node_type"] and t["resources"].get("GPU", 0) >= 1
    }
    assert gpu_types, "no GPU worker type"
    assert all(t["min_workers"] == 0 for t in gpu_types.values())
    gpus = sum(t["max_workers"] * t["resources"]["GPU"] for t in gpu_types.values())
    assert gpus >= 4 and config["max_workers"] >= 4


def test_head_hosts_no_training_worker(config):
    head = config["available_node_types"][config["head_node_type"]]
    # A training worker asks for a CPU (and a GPU with --use-gpu): the head offers neither.
    assert head["resources"].get("CPU", None) == 0
    assert head["resources"].get("GPU", 0) == 0


def test_dashboard_listens_on_loopback_only(config):
    head_start = _commands(config, "head_start_ray_commands")
    assert "ray start --head" in head_start
    assert re.search(r"--dashboard-host[= ]127\.0\.0\.1\b", head_start)
    assert "0.0.0.0" not in yaml.safe_dump(config)


def test_token_authentication_reaches_every_node(config):
    mounts = config["file_mounts"]
    assert mounts.get("~/.ray/auth_token") == "~/.ray/auth_token"
    for key in ("head_start_ray_commands", "worker_start_ray_commands"):
        starts = [c for c in config[key] if "ray start" in c]
        assert starts and all("RAY_AUTH_MODE=token" in c for c in starts), key


def test_the_head_serves_ray_client_with_grpc_fork_handlers_off(config):
    """Ray Client's proxy forks each driver's server while its gRPC threads run; with gRPC's
    fork handlers on, that server now and then dies as it starts (ray-project/ray#63202)."""
    from raytrain_mnist.driver.cluster import CLIENT_HEAD_ENV

    (head_start,) = [c for c in config["head_start_ray_commands"] if "ray start" in c]
    exported = head_start.split(";")[0]
    assert exported.startswith("export ")
    for key, value in CLIENT_HEAD_ENV.items():
        assert f" {key}={value}" in exported, head_start


def test_no_port_open_to_the_world(config):
    # Ray's default security group opens SSH to 0.0.0.0/0; ours are given explicitly.
    for name, node_type in config["available_node_types"].items():
        assert node_type["node_config"].get("SecurityGroupIds"), name
    assert "IpPermissions" not in config["provider"].get("security_group", {})


def test_every_node_requires_imdsv2_and_encrypts_its_root_volume(config):
    for name, node_type in config["available_node_types"].items():
        node = node_type["node_config"]
        # Session tokens only, one hop (no container or forwarded request gets the role).
        assert node.get("MetadataOptions") == {
            "HttpTokens": "required",
            "HttpPutResponseHopLimit": 1,
            "HttpEndpoint": "enabled",
        }, name
        disks = node.get("BlockDeviceMappings") or []
        # /dev/sda1: the root device of the Ubuntu DLAMI the file names (other AMIs differ).
        assert "/dev/sda1" in [disk["DeviceName"] for disk in disks], name
        for disk in disks:
            assert disk.get("Ebs", {}).get("Encrypted") is True, (name, disk)
            assert disk["Ebs"].get("VolumeType") == "gp3", (name, disk)


def test_job_drivers_have_a_node_type_with_the_workers_profile(config):
    """`submit --driver-resource job_driver` places a job's entrypoint on a node that has
    the resource: never the head, which holds the autoscaler's role."""
    types = config["available_node_types"]
    head_type = config["head_node_type"]
    assert "job_driver" not in types[head_type]["resources"]
    drivers = {n: t for n, t in types.items() if t["resources"].get("job_driver", 0) >= 1}
    assert drivers, "no node type offers job_driver"
    for name, node_type in drivers.items():
        assert node_type["node_config"]["IamInstanceProfile"] == {
            "Name": "raytrain-mnist-worker"
        }, name
        assert node_type["resources"].get("GPU", 0) == 0, name  # a driver holds no GPU
        assert node_type["min_workers"] >= 1, name  # a job starts without waiting for a boot
    workers = sum(t["max_workers"] for n, t in types.items() if n != head_type)
    assert config["max_workers"] >= workers


def _requirements() -> dict:
    """pyproject.toml's [project] dependencies: {distribution: packaging's Requirement}."""
    import tomllib
    from packaging.requirements import Requirement

    listed = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    return {r.name: r for r in map(Requirement, listed)}


def _dependencies() -> set[str]:
    """The distributions pyproject.toml's [project] dependencies name (extras dropped)."""
    return set(_requirements())


def _pins(config: dict) -> dict[str, str]:
    """The exact versions the setup commands install: {distribution: version}."""
    return dict(re.findall(r'"([\w.-]+)==([\w.]+)"', _commands(config, "setup_commands")))


def test_checkpoints_go_to_shared_storage_and_the_package_is_installed(config):
    setup = _commands(config, "setup_commands")
    for kind in ("head_setup_commands", "worker_setup_commands"):
        assert re.search(r"RAYTRAIN_MNIST_STORAGE_PATH=s3://\S+", _commands(config, kind)), kind
    assert "~/raytrain-mnist" in config["file_mounts"]
    # The package with its dependencies: pyproject.toml is the one list (serve, rich,
    # tensorboard come with it), nothing installed apart with --no-deps.
    assert re.search(r"pip install (--quiet )?-e ~/raytrain-mnist ", setup)
    assert "--no-deps" not in setup and "ray[" not in setup
    # Every dependency pyproject.toml lists is pinned to an exact version (the comment above
    # the command says so): a node installs what the suite was tested with, nothing newer.
    assert _dependencies() <= set(_pins(config)), _dependencies() - set(_pins(config))
    # Anchored: the package's own driver/runs/ is synced, the checkout's runs/ is not.
    for excluded in ("/data/", "/runs/", "/checkpoints/", ".git/", ".venv/"):
        assert excluded in config["rsync_exclude"]


def test_every_install_gets_the_pinned_versions(config):
    """pyproject.toml admits each pinned version and nothing newer, so make's install, the
    README's by hand and a node's resolve the same versions, whatever is released upstream
    (a new filelock once failed the test below on a fresh clone)."""
    from packaging.version import Version

    specifiers = {name: r.specifier for name, r in _requirements().items()}
    for name, pinned in _pins(config).items():
        if name not in specifiers:
            continue  # a pin pyproject.toml does not list (none today)
        version = Version(pinned)
        newer = (
            f"{version.major}.{version.minor}.{version.micro + 1}",
            f"{version.major}.{version.minor + 1}.0",
            f"{version.major + 1}.0.0",
        )
        assert specifiers[name].contains(version), (name, pinned, str(specifiers[name]))
        assert not any(specifiers[name].contains(v) for v in newer), (name, str(specifiers[name]))


def test_pins_match_the_tested_versions(config):
    """The cluster runs what this checkout is tested with (ray's client and server must
    match), and what tests/test_ray_up.py finds installed: it runs the same pip offline."""
    from importlib.metadata import version

    for name, pinned in _pins(config).items():
        assert version(name).split("+")[0] == pinned, name


def test_the_package_requires_serve_and_the_extras_the_commands_import():
    requires = _requirements()
    assert {"default", "serve", "train", "tune"} <= requires["ray"].extras
    assert "rich" in requires and "tensorboard" in requires


@pytest.fixture(scope="module")
def onprem() -> dict:
    """cluster-onprem.yaml as `ray up` would use it (the local provider's own preparation)."""
    from ray.autoscaler._private.util import prepare_config, validate_config

    prepared = prepare_config(yaml.safe_load(ONPREM_YAML.read_text()))
    validate_config(prepared)
    return prepared


def test_onprem_runs_exactly_the_commands_of_cluster_yaml(raw):
    onprem = yaml.safe_load(ONPREM_YAML.read_text())
    for key in SHARED_KEYS:
        assert onprem[key] == raw[key], key


def test_the_autoscaler_is_v1_and_worker_hosts_leave_nothing_running(raw):
    """`ray up` puts RAY_enable_autoscaler_v2=1 before the head's start commands; v2 cannot
    start the local provider's hosts (ray-project/ray#57153), so the command turns it off
    after it. A worker's log monitor outlives its raylet: workers start without one."""
    (head_start,) = [c for c in raw["head_start_ray_commands"] if "ray start" in c]
    assert re.search(r"RAY_enable_autoscaler_v2=0\b.*ray start --head", head_start)
    (worker_start,) = [c for c in raw["worker_start_ray_commands"] if "ray start" in c]
    assert "--include-log-monitor=false" in worker_start


def test_onprem_is_the_seed_tutorials_two_machines_joining_on_demand(onprem):
    provider = onprem["provider"]
    assert provider["type"] == "local"
    assert provider["head_ip"] == "192.168.1.201" and provider["worker_ips"] == ["192.168.1.202"]
    assert set(onprem["auth"]) == {"ssh_user", "ssh_private_key"}
    # One node type (the local provider's); the worker hosts start with no Ray, join when a
    # run asks and all may join.
    (node_type,) = onprem["available_node_types"].values()
    assert node_type["min_workers"] == 0
    assert node_type["max_workers"] == onprem["max_workers"] == len(provider["worker_ips"])
    # The head trains too: the local provider declares no resources (Ray detects them), so
    # nothing keeps the first rank off node 0, and the autoscaler sizes worker hosts by it.
    assert node_type["resources"] == {}
    for kind in ("head_setup_commands", "worker_setup_commands"):
        assert "RAYTRAIN_MNIST_STORAGE_PATH=/" in _commands(onprem, kind), kind
    assert "0.0.0.0" not in yaml.safe_dump(onprem)


@pytest.mark.parametrize("path", [CLUSTER_YAML, ONPREM_YAML], ids=lambda p: p.name)
def test_every_key_is_commented(path):
    """Ray's example-minimal.yaml style: a comment above (or beside) every key."""
    lines = path.read_text().splitlines()
    uncommented = []
    for i, line in enumerate(lines):
        key = re.match(r"^\s*(- )?([\w.\"~/-]+)\s*:(\s|$)", line)
        if not key or line.lstrip().startswith("#"):
            continue
        previous = lines[i - 1].strip() if i else ""
        if not (previous.startswith("#") or "#" in line):
            uncommented.append(line.strip())
    assert not uncommented, f"keys without a comment: {uncommented}"


IAM = REPO / "docs" / "iam"


def _statements(name: str) -> list[dict]:
    import json

    policy = json.loads((IAM / name).read_text())
    assert policy["Version"] == "2012-10-17"
    return policy["Statement"]


def _runs_location(config: dict) -> tuple[str, str]:
    """The bucket and prefix the nodes store runs in (RAYTRAIN_MNIST_STORAGE_PATH)."""
    found = re.search(
        r"RAYTRAIN_MNIST_STORAGE_PATH=s3://([^/\s']+)/([^\s']+)",
        _commands(config, "head_setup_commands"),
    )
    assert found, "no s3:// storage path in head_setup_commands"
    return found[1], found[2].rstrip("/")


def test_gpu_workers_have_their_own_least_privilege_profile(config):
    head_type = config["head_node_type"]
    head = config["available_node_types"][head_type]["node_config"]
    # The head keeps what Ray gives it (ray-autoscaler-v1): it launches the workers.
    assert (
        head.get("IamInstanceProfile", {}).get("Name", "ray-autoscaler-v1") == "ray-autoscaler-v1"
    )
    for name, node_type in config["available_node_types"].items():
        if name == head_type:
            continue
        assert node_type["node_config"]["IamInstanceProfile"] == {
            "Name": "raytrain-mnist-worker"
        }, name


def test_the_worker_policy_grants_objects_under_the_runs_prefix_only(config):
    bucket, prefix = _runs_location(config)
    allowed_object_actions = {
        "s3:GetObject",
        "s3:PutObject",
        "s3:DeleteObject",
        "s3:AbortMultipartUpload",
        "s3:ListMultipartUploadParts",
    }
    granted = set()
    for statement in _statements("worker-policy.json"):
        assert statement["Effect"] == "Allow"
        assert "NotAction" not in statement and "NotResource" not in statement
        actions = statement["Action"]
        actions = {actions} if isinstance(actions, str) else set(actions)
        resources = statement["Resource"]
        resources = [resources] if isinstance(resources, str) else resources
        assert not any("*" in action for action in actions), actions
        granted |= actions
        for resource in resources:
            if actions <= allowed_object_actions:
                assert resource == f"arn:aws:s3:::{bucket}/{prefix}/*", resource
            else:  # bucket-level: where the bucket is, HeadBucket and listing
                assert actions <= {"s3:ListBucket", "s3:GetBucketLocation"}, actions
                assert resource == f"arn:aws:s3:::{bucket}", resource
        if "s3:ListBucket" in actions:
            # Unconditioned: pyarrow's create_dir sends HeadBucket, which AWS authorizes with
            # s3:ListBucket and which carries no s3:prefix (tests/test_iam.py runs it).
            assert "Condition" not in statement, statement
    # Checkpoints are written, read back on resume and pruned (--keep-checkpoints).
    assert {"s3:GetObject", "s3:PutObject", "s3:DeleteObject", "s3:ListBucket"} <= granted


def test_the_head_may_pass_exactly_the_worker_role():
    (trust,) = _statements("worker-trust.json")
    assert trust["Principal"] == {"Service": "ec2.amazonaws.com"}
    assert trust["Action"] == "sts:AssumeRole"
    (pass_role,) = _statements("head-pass-worker-role.json")
    assert pass_role["Action"] == "iam:PassRole"
    assert re.fullmatch(r"arn:aws:iam::[\w-]+:role/raytrain-mnist-worker", pass_role["Resource"])
