"""The cluster definitions in clusters/: Ray's own schema, GPU pools, and a security lint."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import jsonschema
import pytest
import yaml

from raytrain_loops.tools.check_clusters import effective_config, main, problems, ray_schema

CLUSTERS = Path(__file__).resolve().parents[2] / "clusters"
LAUNCHERS = sorted(CLUSTERS.glob("*.yaml"))
KUBERAY = sorted((CLUSTERS / "kuberay").glob("*.yaml"))
DOCKERFILE = CLUSTERS / "kuberay" / "Dockerfile"


def test_there_are_launcher_and_kuberay_files():
    assert [p.name for p in LAUNCHERS] == ["aws.yaml", "gcp.yaml"]
    assert [p.name for p in KUBERAY] == ["raycluster.yaml", "rayjob.yaml"]


@pytest.mark.parametrize("path", [*LAUNCHERS, *KUBERAY, DOCKERFILE], ids=lambda p: p.name)
def test_every_cluster_file_passes_schema_and_security_lint(path):
    assert problems(path) == []


@pytest.mark.parametrize("path", LAUNCHERS, ids=lambda p: p.name)
def test_launchers_define_gpu_pools_beside_a_cpu_only_head(path):
    cfg = yaml.safe_load(path.read_text())
    jsonschema.validate(cfg, ray_schema())
    types = cfg["available_node_types"]
    head = types.pop(cfg["head_node_type"])
    assert head["resources"] == {"CPU": 0, "GPU": 0}
    gpus = sorted(t["resources"]["GPU"] for t in types.values() if t["resources"]["GPU"])
    assert gpus[0] == 1 and gpus[-1] == 8 and 4 in gpus
    # Preprocessing's own CPUs: a CPU-only pool, the only one advertising data.preprocess.resources' resource.
    preprocess = [t["resources"] for t in types.values() if "preprocess" in t["resources"]]
    assert (
        len(preprocess) == 1 and preprocess[0]["GPU"] == 0 and preprocess[0]["preprocess"] == preprocess[0]["CPU"] > 0
    )
    assert all(0 == t["min_workers"] < t["max_workers"] for t in types.values())
    text = yaml.safe_dump(types)
    assert ("MarketType: spot" in text or "provisioningModel: SPOT" in text) and any(
        "spot" not in name for name in types
    ), "spot and on-demand pools"
    assert any("raytrain_loops" in c for c in cfg["setup_commands"]), "setup installs this package"


def test_kuberay_cluster_requests_the_pools_gpus():
    cluster = yaml.safe_load((CLUSTERS / "kuberay" / "raycluster.yaml").read_text())
    assert cluster["kind"] == "RayCluster" and cluster["spec"]["headGroupSpec"]["rayStartParams"]["num-cpus"] == "0"
    pools = {g["groupName"]: g for g in cluster["spec"]["workerGroupSpecs"]}
    limits = {name: g["template"]["spec"]["containers"][0]["resources"]["limits"] for name, g in pools.items()}
    assert sorted(int(lim["nvidia.com/gpu"]) for lim in limits.values() if "nvidia.com/gpu" in lim) == [1, 4, 8]
    cpu_only = [name for name, lim in limits.items() if "nvidia.com/gpu" not in lim]
    assert len(cpu_only) == 1, "one CPU-only group, for preprocessing"
    params = pools[cpu_only[0]]["rayStartParams"]
    assert json.loads(yaml.safe_load(params["resources"])) == {"preprocess": int(params["num-cpus"])}
    assert all(g["minReplicas"] == 0 < g["maxReplicas"] for g in pools.values())
    job = yaml.safe_load((CLUSTERS / "kuberay" / "rayjob.yaml").read_text())
    assert job["kind"] == "RayJob" and job["spec"]["clusterSelector"]["ray.io/cluster"] == cluster["metadata"]["name"]
    assert job["spec"]["entrypoint"].startswith("raytrain-loops train ")


def test_the_lint_catches_what_it_is_for(tmp_path):
    cfg = yaml.safe_load((CLUSTERS / "aws.yaml").read_text())
    cfg["provider"]["security_group"] = {
        "GroupName": "raytrain-loops",
        "IpPermissions": [
            {"FromPort": 8265, "ToPort": 8265, "IpProtocol": "tcp", "IpRanges": [{"CidrIp": "0.0.0.0/0"}]}
        ],
    }
    cfg["head_start_ray_commands"][1] = "ray start --head --port=6379 --dashboard-host=0.0.0.0"
    cfg["available_node_types"]["head"]["resources"] = {"CPU": 8, "GPU": 0}
    cfg["available_node_types"]["gpu_1x_a10g_spot"]["resources"]["GPU"] = "one"
    cfg["setup_commands"].append("export AWS_ACCESS_KEY_ID=AKIAABCDEFGHIJKLMNOP")
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(cfg))
    found = "\n".join(problems(bad))
    for fragment in (
        "opens a port to 0.0.0.0/0",
        "starts Ray without RAY_AUTH_MODE=token",
        "the dashboard listens on every interface",
        "head node type must declare resources CPU: 0",
        "gpu_1x_a10g_spot.resources.GPU: 'one' is not of type 'integer'",
        "holds an AWS access key id",
    ):
        assert fragment in found, fragment
    k8s = yaml.safe_load((CLUSTERS / "kuberay" / "raycluster.yaml").read_text())
    k8s["spec"]["headGroupSpec"]["serviceType"] = "LoadBalancer"
    k8s["spec"]["workerGroupSpecs"][0]["template"]["spec"]["containers"][0]["env"] = [
        {"name": "RAY_AUTH_MODE", "value": "disabled"}
    ]
    bad_k8s = tmp_path / "bad-k8s.yaml"
    bad_k8s.write_text(yaml.safe_dump(k8s))
    found = "\n".join(problems(bad_k8s))
    assert "serviceType LoadBalancer exposes Ray's ports" in found
    assert "group gpu-1x-a10g-spot: container ray-worker lacks RAY_AUTH_MODE=token" in found


def test_ray_creates_no_security_group_and_gives_no_public_address_to_the_shipped_launchers():
    from ray.autoscaler._private.aws import config as aws
    from ray.autoscaler._private.gcp import config as gcp

    # Both bootstrap steps return before any cloud call when the file settles the network; a
    # node type they would fill in (a new group, a default interface) needs the API and fails.
    network = aws._configure_from_network_interfaces(
        effective_config(yaml.safe_load((CLUSTERS / "aws.yaml").read_text()))
    )
    assert aws._configure_security_group(copy.deepcopy(network)) == network
    for node_type in network["available_node_types"].values():
        assert node_type["node_config"]["SecurityGroupIds"], "an existing group by id"
        assert all(nic["AssociatePublicIpAddress"] is False for nic in node_type["node_config"]["NetworkInterfaces"])
    gcp_cfg = effective_config(yaml.safe_load((CLUSTERS / "gcp.yaml").read_text()))
    for node_type in gcp._configure_subnet(gcp_cfg, None)["available_node_types"].values():
        assert all("accessConfigs" not in nic for nic in node_type["node_config"]["networkInterfaces"])
    for cfg in (network, gcp_cfg):
        assert cfg["provider"]["use_internal_ips"] is True and cfg["auth"]["ssh_proxy_command"]


def _node_config(cfg, node_type):
    return cfg["available_node_types"][node_type]["node_config"]


def _public_nic(cfg):
    nc = _node_config(cfg, "gpu_8x_h100_ondemand")
    nc["NetworkInterfaces"] = [{**nc["NetworkInterfaces"][0], "AssociatePublicIpAddress": True}]


def _no_nic(cfg):
    del _node_config(cfg, "gpu_1x_a10g_spot")["NetworkInterfaces"]


def _launch_template(cfg):
    _node_config(cfg, "head")["LaunchTemplate"] = {"LaunchTemplateName": "raytrain-loops"}


def _gcp_access_config(cfg):
    nc = _node_config(cfg, "gpu_1x_a100_spot")
    nc["networkInterfaces"] = [{**nc["networkInterfaces"][0], "accessConfigs": [{"type": "ONE_TO_ONE_NAT"}]}]


def _gcp_no_nic(cfg):
    del _node_config(cfg, "head")["networkInterfaces"]


def _unpinned_torch(cfg):
    cfg["setup_commands"] = [c.replace("torch==2.13.0", "torch>=2.6") for c in cfg["setup_commands"]]


def _head_group(doc):
    return doc["spec"]["headGroupSpec"]


def _extra_service(doc):
    service = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "dash"}, "spec": {"type": "NodePort"}}
    return [doc, service]


BAD_COPIES = {
    # name: (file, change made to a copy, what the lint must say)
    "aws-ray-made-group": ("aws.yaml", _no_nic, "so Ray creates one whose rules open tcp 22-22 from 0.0.0.0/0"),
    "aws-public-ip": ("aws.yaml", _public_nic, "node type gpu_8x_h100_ondemand: may get a public IP"),
    "aws-launch-template": ("aws.yaml", _launch_template, "a LaunchTemplate's network cannot be checked offline"),
    "aws-public-addresses": (
        "aws.yaml",
        lambda c: c["provider"].pop("use_internal_ips"),
        "provider.use_internal_ips must be true",
    ),
    "aws-direct-ssh": ("aws.yaml", lambda c: c["auth"].pop("ssh_proxy_command"), "auth.ssh_proxy_command is not set"),
    "aws-ray-default-start": (
        "aws.yaml",
        lambda c: c.pop("head_start_ray_commands"),
        "head_start_ray_commands: the dashboard listens on every interface or is left to a default (--dashboard-host=0.0.0.0)",
    ),
    "aws-unpinned-torch": ("aws.yaml", _unpinned_torch, "worker_setup_commands: no command installs an exact torch"),
    "aws-rsync-runs": ("aws.yaml", lambda c: c["rsync_exclude"].remove("runs"), "rsync_exclude lacks runs"),
    "aws-docker-latest": (
        "aws.yaml",
        lambda c: c.update(docker={"image": "rayproject/ray:latest-gpu", "container_name": "ray"}),
        "docker.image: image rayproject/ray:latest-gpu is not pinned",
    ),
    "gcp-external-ip": (
        "gcp.yaml",
        _gcp_access_config,
        "gpu_1x_a100_spot: networkInterfaces[0] has accessConfigs (as written)",
    ),
    "gcp-ray-default-nic": ("gcp.yaml", _gcp_no_nic, "head: networkInterfaces[0] has accessConfigs (Ray's default)"),
    "gcp-not-iap": (
        "gcp.yaml",
        lambda c: c["auth"].update(ssh_proxy_command="ssh -W %h:%p bastion"),
        "does not go through IAP",
    ),
    "kuberay-dashboard-default": (
        "kuberay/raycluster.yaml",
        lambda d: _head_group(d)["rayStartParams"].pop("dashboard-host"),
        "leave dashboard-host to KubeRay's default (0.0.0.0)",
    ),
    "kuberay-head-service": (
        "kuberay/raycluster.yaml",
        lambda d: _head_group(d).update(headService={"spec": {"type": "LoadBalancer"}}),
        "headService type LoadBalancer exposes Ray's ports",
    ),
    "kuberay-ingress": (
        "kuberay/raycluster.yaml",
        lambda d: _head_group(d).update(enableIngress=True),
        "enableIngress creates an Ingress to the dashboard",
    ),
    "kuberay-node-port": ("kuberay/raycluster.yaml", _extra_service, "raycluster.yaml[1]: Service type NodePort"),
    "kuberay-host-network": (
        "kuberay/raycluster.yaml",
        lambda d: _head_group(d)["template"]["spec"].update(hostNetwork=True),
        "group head: hostNetwork puts Ray's ports on the node's address",
    ),
    "kuberay-latest": (
        "kuberay/raycluster.yaml",
        lambda d: d["spec"]["workerGroupSpecs"][1]["template"]["spec"]["containers"][0].update(image="rayproject/ray"),
        "group gpu-4x-a100-ondemand: container ray-worker: image rayproject/ray is not pinned (no tag (latest))",
    ),
    "kuberay-major-tag": (
        "kuberay/rayjob.yaml",
        lambda d: d["spec"]["submitterPodTemplate"]["spec"]["containers"][0].update(image="rayproject/ray:2"),
        "submitter: container ray-job-submitter: image rayproject/ray:2 is not pinned (tag '2')",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_COPIES))
def test_each_lint_rule_fails_a_bad_copy_of_a_shipped_file(tmp_path, case):
    name, change, fragment = BAD_COPIES[case]
    doc = copy.deepcopy(yaml.safe_load((CLUSTERS / name).read_text()))
    result = change(doc)
    bad = tmp_path / Path(name).name
    bad.write_text(yaml.safe_dump_all(result if change is _extra_service else [doc]))
    found = problems(bad)
    assert any(fragment in p for p in found), found


def test_the_dockerfile_lint_wants_pinned_images_and_torch(tmp_path):
    bad = tmp_path / "Dockerfile"
    bad.write_text(DOCKERFILE.read_text().replace("2.60.0-py311-gpu", "latest-gpu").replace("torch==2.13.0", "torch"))
    found = problems(bad)
    assert (
        "Dockerfile: FROM: image rayproject/ray:latest-gpu is not pinned (tag 'latest-gpu'); use an exact version tag or @sha256 digest"
        in found
    )
    assert "Dockerfile: no pip install pins torch to an exact version (torch==X.Y.Z)" in found
    digest = "rayproject/ray@sha256:" + "0" * 64
    bad.write_text(DOCKERFILE.read_text().replace("rayproject/ray:2.60.0-py311-gpu", digest))
    assert problems(bad) == []


def test_the_lint_is_a_command_whose_exit_status_says_whether_a_file_has_problems(tmp_path, capsys):
    broken = tmp_path / "aws.yaml"
    cfg = yaml.safe_load((CLUSTERS / "aws.yaml").read_text())
    cfg["head_start_ray_commands"] = ["ray start --head --dashboard-host=0.0.0.0"]
    broken.write_text(yaml.safe_dump(cfg))
    assert main([str(CLUSTERS / "aws.yaml")]) == 0
    assert main([str(broken)]) == 1
    out = capsys.readouterr().out.splitlines()
    assert out and all(line.startswith("aws.yaml: head_start_ray_commands") for line in out), out
