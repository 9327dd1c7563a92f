"""cluster.yaml is valid for `ray up` and keeps its promises; offline, no cloud calls."""

from __future__ import annotations

import copy
import re

import pytest
import yaml

from .conftest import REPO

CLUSTER_YAML = REPO / "cluster.yaml"


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


def test_checkpoints_go_to_shared_storage_and_the_package_is_installed(config):
    setup = _commands(config, "setup_commands")
    assert re.search(r"RAYTRAIN_MNIST_STORAGE_PATH=s3://\S+", setup)
    assert "~/raytrain_mnist" in config["file_mounts"]
    assert re.search(r"pip install .*-e ~/raytrain_mnist", setup)
    # Every dependency of the package is pinned to an exact version.
    for requirement in (
        "ray[default,train,tune]",
        "torch",
        "torchvision",
        "numpy",
        "filelock",
        "matplotlib",
        "mlxtend",
    ):
        assert re.search(rf'"{re.escape(requirement)}==[\d.]+"', setup), requirement
    for excluded in ("data/", "runs/", "checkpoints/", ".git/", ".venv/"):
        assert excluded in config["rsync_exclude"]


def test_pins_match_the_tested_versions(config):
    """The cluster runs what this checkout is tested with (ray's client and server must match)."""
    import ray
    import torch

    setup = _commands(config, "setup_commands")
    assert f'"ray[default,train,tune]=={ray.__version__}"' in setup
    assert f'"torch=={torch.__version__.split("+")[0]}"' in setup


def test_every_key_is_commented():
    """Ray's example-minimal.yaml style: a comment above (or beside) every key."""
    lines = CLUSTER_YAML.read_text().splitlines()
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
        _commands(config, "setup_commands"),
    )
    assert found, "no s3:// storage path in setup_commands"
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
