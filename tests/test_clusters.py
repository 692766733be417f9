"""The cluster definitions in clusters/: Ray's own schema, GPU pools, and a security lint."""

from __future__ import annotations

from pathlib import Path

import jsonschema
import pytest
import yaml

from raytrain_loops.launch.clusters import problems, ray_schema

CLUSTERS = Path(__file__).resolve().parents[1] / "clusters"
LAUNCHERS = sorted(CLUSTERS.glob("*.yaml"))
KUBERAY = sorted((CLUSTERS / "kuberay").glob("*.yaml"))


def test_there_are_launcher_and_kuberay_files():
    assert [p.name for p in LAUNCHERS] == ["aws.yaml", "gcp.yaml"]
    assert [p.name for p in KUBERAY] == ["raycluster.yaml", "rayjob.yaml"]


@pytest.mark.parametrize("path", LAUNCHERS + KUBERAY, ids=lambda p: p.name)
def test_every_cluster_file_passes_schema_and_security_lint(path):
    assert problems(path) == []


@pytest.mark.parametrize("path", LAUNCHERS, ids=lambda p: p.name)
def test_launchers_define_gpu_pools_beside_a_cpu_only_head(path):
    cfg = yaml.safe_load(path.read_text())
    jsonschema.validate(cfg, ray_schema())
    types = cfg["available_node_types"]
    head = types.pop(cfg["head_node_type"])
    assert head["resources"] == {"CPU": 0, "GPU": 0}
    gpus = sorted(t["resources"]["GPU"] for t in types.values())
    assert gpus[0] == 1 and gpus[-1] == 8 and 4 in gpus
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
    limits = {
        name: int(g["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"])
        for name, g in pools.items()
    }
    assert sorted(limits.values()) == [1, 4, 8]
    assert all(g["minReplicas"] == 0 < g["maxReplicas"] for g in pools.values())
    job = yaml.safe_load((CLUSTERS / "kuberay" / "rayjob.yaml").read_text())
    assert job["kind"] == "RayJob" and job["spec"]["clusterSelector"]["ray.io/cluster"] == cluster["metadata"]["name"]
    assert job["spec"]["entrypoint"].startswith("raytrain-loops train ")


def test_the_lint_catches_what_it_is_for(tmp_path):
    cfg = yaml.safe_load((CLUSTERS / "aws.yaml").read_text())
    cfg["provider"]["security_group"]["IpPermissions"].append(
        {"FromPort": 8265, "ToPort": 8265, "IpProtocol": "tcp", "IpRanges": [{"CidrIp": "0.0.0.0/0"}]}
    )
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
