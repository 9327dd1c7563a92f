"""`submit`'s choice of where a job's driver runs, before anything is sent: on a cluster
with a node that offers `job_driver` (cluster.yaml's ray.driver.cpu) it asks for that unless
told otherwise (`--driver-resource none`: the head); `--env` pairs that would leak a secret
or that Ray would refuse are one line.

Where the driver then runs on a real cluster (a node offering `job_driver` joined to a
head), and that `--env` reaches the job's runtime environment, is tested on the Jobs API
head that tests/test_submit.py starts anyway: one Ray cluster fewer.
"""

from __future__ import annotations

import re

import pytest

from raytrain_mnist import submit
from raytrain_mnist.errors import UserError

from .conftest import REPO


@pytest.mark.parametrize(
    "pair, fragment",
    [
        ("AWS_SECRET_ACCESS_KEY=wJalrXUtnFEMIK7MDENG", "--env AWS_SECRET_ACCESS_KEY: the job's"),
        ("RAYTRAIN_MNIST_SERVE_TOKEN=wJalrXUtnFEMIK7MDENG", "job table"),
        ("STORE=s3://AKIA:wJalrXUtnFEMIK7MDENG@bucket", "carries credentials"),
        ("NOVALUE", "--env takes NAME=VALUE"),
        ("1X=y", "--env takes NAME=VALUE"),
    ],
)
def test_a_secret_in_env_is_refused_in_one_line_without_its_value(pair, fragment):
    with pytest.raises(UserError, match=re.escape(fragment)) as info:
        submit.parse(["--env", pair, "--", "fit"])
    assert info.value.exit_code == 2 and "wJalrXUtnFEMIK7MDENG" not in str(info.value)


@pytest.mark.parametrize("name", ["CPU", "GPU", "memory", "", "job driver"])
def test_a_driver_resource_ray_would_refuse_is_one_line_before_anything_is_sent(name):
    with pytest.raises(UserError, match="--driver-resource") as info:
        submit.parse(["--driver-resource", name, "--", "fit"])
    assert info.value.exit_code == 2


def test_the_default_is_decided_on_the_cluster_and_the_environment_can_set_it(monkeypatch):
    monkeypatch.delenv("RAYTRAIN_MNIST_DRIVER_RESOURCE", raising=False)
    assert submit.parse(["--", "fit"]).driver_resource is None  # job_driver where offered
    assert submit.parse(["--driver-resource", "none", "--", "fit"]).driver_resource == "none"
    monkeypatch.setenv("RAYTRAIN_MNIST_DRIVER_RESOURCE", "job_driver")
    assert submit.parse(["--", "fit"]).driver_resource == "job_driver"
    assert submit.parse(["--driver-resource", "other", "--", "fit"]).driver_resource == "other"


def test_cluster_yaml_offers_the_resource_submit_asks_for_by_default():
    import yaml

    from raytrain_mnist.driver.jobs import DRIVER_RESOURCE

    config = yaml.safe_load((REPO / "cluster.yaml").read_text())
    offered = {
        name: node_type.get("min_workers", 0)
        for node_type in config["available_node_types"].values()
        for name in node_type["resources"]
        if name not in ("CPU", "GPU")
    }
    # Offered by a node that `ray up` starts (min_workers >= 1): submit finds it live.
    assert offered.get(DRIVER_RESOURCE, 0) >= 1, offered
    docs = (REPO / "docs" / "cluster.md").read_text()
    asked = set(re.findall(r"--driver-resource ([a-z_]\w*)", docs)) - {"none"}  # none: the head
    assert DRIVER_RESOURCE in docs and asked <= set(offered), (asked, offered)
