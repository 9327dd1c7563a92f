"""On a cluster with a node that offers `job_driver` (cluster.yaml's ray.driver.cpu), `submit`
runs the job's driver there unless told otherwise (`--driver-resource none`: the head); on a
cluster without one, on the head. `--env` reaches the job's runtime environment.

A real two-node Ray on this machine, on 127.0.0.1: a head with 0 CPUs and no job_driver (its
dashboard and Jobs API on loopback) and a node with ``resources={"job_driver": 1}``.
The job is a real submit of `evaluate` of a run that does not exist (it fails in seconds;
where its driver ran is the point): the Jobs API records the driver's node. Every process
carries a marker and is killed by it; nothing else is touched.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from pathlib import Path

import pytest

from raytrain_mnist import submit
from raytrain_mnist.errors import UserError

from .conftest import MARKER_VAR, REPO, free_ports, kill_marked


@pytest.fixture(scope="module")
def cluster():
    from ray.cluster_utils import Cluster
    from ray.util.state import list_nodes

    from raytrain_mnist.driver.cluster import loopback_node

    root = Path(tempfile.mkdtemp(prefix="rtjp", dir="/tmp"))  # short: Ray's socket paths
    marker = uuid.uuid4().hex
    # Every port ours: Ray's default agent port (52365) may be another Ray's on this machine,
    # and a head whose agent cannot bind it takes no job ("No available agent").
    dashboard, head_agent, node_agent = free_ports(3)
    url = f"http://127.0.0.1:{dashboard}"
    os.environ[MARKER_VAR] = marker  # inherited by every process of both nodes, and drivers
    try:
        with loopback_node():  # both nodes on 127.0.0.1, listening on nothing else
            cluster = Cluster(
                initialize_head=True,
                head_node_args={
                    "num_cpus": 0,  # as cluster.yaml's head: no CPU, no job_driver
                    "include_dashboard": True,
                    "dashboard_host": "127.0.0.1",
                    "dashboard_port": dashboard,
                    "dashboard_agent_listen_port": head_agent,
                    "temp_dir": str(root),
                },
            )
            cluster.add_node(
                num_cpus=1, resources={"job_driver": 1}, dashboard_agent_listen_port=node_agent
            )
    finally:
        del os.environ[MARKER_VAR]
    try:
        cluster.wait_for_nodes()
        deadline = time.monotonic() + 300  # a loaded machine starts the agents late
        nodes: dict[str, str] = {}
        while len(nodes) < 2:
            try:
                urllib.request.urlopen(f"{url}/api/jobs/", timeout=5).close()
                alive = list_nodes(address=url, filters=[("state", "=", "ALIVE")])
                nodes = {"head" if n.is_head_node else "driver": n.node_id for n in alive}
            except Exception:
                pass
            assert time.monotonic() < deadline, "the Jobs API or the driver node never came"
            time.sleep(0.5)
        from ray.job_submission import JobSubmissionClient

        while True:  # the head's job agent answers some seconds after the dashboard
            try:
                JobSubmissionClient(url).submit_job(entrypoint="true")
                break
            except RuntimeError as exc:
                assert "No available agent" in str(exc), exc
                assert time.monotonic() < deadline, exc
                time.sleep(1)
        yield {"url": url, **nodes}
    finally:
        cluster.shutdown()
        kill_marked(marker)  # the job drivers, if any outlived their nodes: ours only
        shutil.rmtree(root, ignore_errors=True)


def _submit(cluster, *flags: str, env: dict | None = None, seen: list | None = None) -> str:
    """Submit `evaluate` of a missing run with ``flags``; the node its driver ran on (and
    the job's info appended to ``seen``)."""
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "raytrain_mnist",
            "submit",
            "--address",
            cluster["url"],
            "--no-wait",
            *flags,
            "--",
            "evaluate",
            "/nonexistent/run",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
        env={**os.environ, **(env or {})},
        stdin=subprocess.DEVNULL,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    job_id = proc.stdout.strip()
    from ray.job_submission import JobStatus, JobSubmissionClient

    jobs = JobSubmissionClient(cluster["url"])
    deadline = time.monotonic() + 120
    while True:
        info = jobs.get_job_info(job_id)
        if info.status in (JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.STOPPED):
            break
        assert time.monotonic() < deadline, info
        time.sleep(0.5)
    if seen is not None:
        seen.append(info)
    # It ran (evaluate refused the missing run), and the Jobs API says where.
    assert info.driver_exit_code not in (None, 0), info
    where = "the head" if info.driver_node_id == cluster["head"] else "a node offering job_driver"
    assert f"(driver on {where})" in proc.stderr, proc.stderr
    return info.driver_node_id


def test_the_driver_runs_on_the_driver_node_unless_told_otherwise_and_env_reaches_it(
    cluster, monkeypatch
):
    monkeypatch.delenv("RAYTRAIN_MNIST_DRIVER_RESOURCE", raising=False)
    # By default: the cluster offers job_driver, so the driver goes there, not to the head.
    assert _submit(cluster) == cluster["driver"]
    # Asked for by name, the same; this job also carries `--env`, which reaches the job's
    # runtime environment (checked on a job of this test: one job fewer).
    seen: list = []
    env_flags = ("--env", "NCCL_DEBUG=INFO", "--env", "PROBE=a=b")
    driver_node = _submit(cluster, "--driver-resource", "job_driver", *env_flags, seen=seen)
    assert driver_node == cluster["driver"]
    (info,) = seen
    assert info.runtime_env["env_vars"] == {"NCCL_DEBUG": "INFO", "PROBE": "a=b"}
    # Told otherwise: Ray's own placement, the head.
    assert _submit(cluster, "--driver-resource", "none") == cluster["head"]
    assert _submit(cluster, env={"RAYTRAIN_MNIST_DRIVER_RESOURCE": "none"}) == cluster["head"]


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
