"""Checks for the cluster definitions in ``clusters/``: Ray's own schema and a security lint.

``problems(path)`` returns what is wrong with a Ray cluster-launcher YAML, a KubeRay manifest or
the image's Dockerfile, one sentence per problem naming the place; an empty list means it passed.

A launcher YAML is judged as Ray will run it, not as written: it goes through Ray's own
``prepare_config`` (which fills in every key the file leaves out from the provider's defaults,
among them a head start command with ``--dashboard-host=0.0.0.0``) and ``validate_config``, then
through the offline parts of the AWS and GCP bootstrap code that decide the network: which node
types get a security group Ray creates (with Ray's default rules, SSH from 0.0.0.0/0 among them)
and which GCP nodes get the external IP Ray's default network interface asks for. Nothing here
calls a cloud API.
"""

from __future__ import annotations

import copy
import json
import os
import re
import sys
from pathlib import Path
from typing import Any

import yaml

from raytrain_loops import ray_private

SECRET_PATTERNS = {
    "an AWS access key id": re.compile(r"\b(AKIA|ASIA)[0-9A-Z]{16}\b"),
    "an AWS secret access key": re.compile(r"aws_secret_access_key\s*[:=]\s*\S+", re.I),
    "a private key": re.compile(r"-----BEGIN [A-Z ]*PRIVATE KEY-----"),
    "a service-account key": re.compile(r'"private_key"\s*:'),
    "a literal Ray token": re.compile(r"RAY_AUTH_TOKEN\s*[=:]\s*['\"]?[0-9a-f]{16,}", re.I),
}
PUBLIC = ("0.0.0.0/0", "::/0")
WILDCARD_HOSTS = ("0.0.0.0", "::", "[::]")
LOOPBACK_HOSTS = ("127.0.0.1", "localhost")
TORCH_PIN = re.compile(r"""(?<![\w.-])torch==\d+\.\d+\.\d+""")
PINNED_TAG = re.compile(r"^v?\d+\.\d+\.\d+([.+-][\w.+-]*)?$")
RSYNC_EXCLUDED = (".venv", "runs")


def ray_schema() -> dict[str, Any]:
    """Ray's cluster-config JSON schema, as shipped in the installed ray package."""
    import ray.autoscaler

    with open(os.path.join(os.path.dirname(ray.autoscaler.__file__), "ray-schema.json")) as f:
        return json.load(f)


def _secrets(text: str, where: str) -> list[str]:
    return [
        f"{where}: holds {what}; mount it or use a secret store"
        for what, rx in SECRET_PATTERNS.items()
        if rx.search(text)
    ]


def _public_ranges(text: str, where: str) -> list[str]:
    return [f"{where}: opens a port to {cidr}" for cidr in PUBLIC if cidr in text]


def image_problem(image: str, where: str) -> str | None:
    """Why ``image`` is not pinned (a digest or an exact version tag such as 2.60.0), or None."""
    if re.search(r"@sha256:[0-9a-f]{64}$", image):
        return None
    name = image.rsplit("/", 1)[-1]
    tag = name.split(":", 1)[1] if ":" in name else ""
    if PINNED_TAG.match(tag):
        return None
    found = f"tag {tag!r}" if tag else "no tag (latest)"
    return f"{where}: image {image} is not pinned ({found}); use an exact version tag or @sha256 digest"


# ----------------------------------------------------------------------- cluster launcher


def _schema_problems(cfg: dict[str, Any], where: str) -> list[str]:
    import jsonschema

    try:
        jsonschema.validate(cfg, ray_schema())
    except jsonschema.ValidationError as err:
        path = ".".join(str(p) for p in err.absolute_path) or "(top level)"
        return [f"{where}: {path}: {err.message} (Ray's cluster-config schema)"]
    return []


def effective_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """``cfg`` as ``ray up`` runs it: Ray's ``prepare_config`` then ``validate_config``."""
    prepare, validate = ray_private.prepare_config(), ray_private.validate_config()
    prepared = prepare(copy.deepcopy(cfg))
    validate(prepared)
    return prepared


def _start_problems(cfg: dict[str, Any], where: str) -> list[str]:
    starts = [("head_start_ray_commands", c) for c in cfg.get("head_start_ray_commands", [])]
    starts += [("worker_start_ray_commands", c) for c in cfg.get("worker_start_ray_commands", [])]
    out = []
    for key, cmd in starts:
        if "ray start" in cmd and "RAY_AUTH_MODE=token" not in cmd:
            out.append(f"{where}: {key}: `{cmd}` starts Ray without RAY_AUTH_MODE=token")
        host = re.search(r"--dashboard-host[= ](\S+)", cmd)
        if "--head" in cmd and (host is None or host.group(1) not in LOOPBACK_HOSTS):
            found = f"--dashboard-host={host.group(1)}" if host else "no --dashboard-host"
            out.append(
                f"{where}: {key}: the dashboard listens on every interface or is left to a default ({found}); use --dashboard-host=127.0.0.1"
            )
    if not any("ray start" in c for _, c in starts):
        out.append(f"{where}: no ray start commands, so token authentication cannot be checked")
    return out


def _setup_problems(cfg: dict[str, Any], where: str) -> list[str]:
    out = []
    # prepare_config has merged setup_commands into both lists: these are what each node runs.
    for key in ("head_setup_commands", "worker_setup_commands"):
        if not any(TORCH_PIN.search(c) for c in cfg.get(key, [])):
            out.append(f"{where}: {key}: no command installs an exact torch version (torch==X.Y.Z)")
    excluded = {str(p).strip("/").removeprefix("**/") for p in cfg.get("rsync_exclude", [])}
    missing = [p for p in RSYNC_EXCLUDED if p not in excluded]
    if missing:
        out.append(f"{where}: rsync_exclude lacks {', '.join(missing)} (they would be copied onto every node)")
    images = [("docker", cfg.get("docker", {}))]
    images += [(f"available_node_types.{k}.docker", t.get("docker", {})) for k, t in _types(cfg).items()]
    for place, docker in images:
        for key in ("image", "head_image", "worker_image"):
            problem = image_problem(docker[key], f"{where}: {place}.{key}") if docker.get(key) else None
            out += [problem] if problem else []
    return out


def _head_problems(cfg: dict[str, Any], where: str) -> list[str]:
    out = []
    head = _types(cfg).get(cfg.get("head_node_type", ""), {})
    if head.get("resources", {}).get("CPU", None) != 0 or head.get("resources", {}).get("GPU", 0) != 0:
        out.append(f"{where}: the head node type must declare resources CPU: 0 and GPU: 0 (no training worker on it)")
    if not any(str(k).endswith(".ray/auth_token") for k in cfg.get("file_mounts", {})):
        out.append(f"{where}: file_mounts does not mount ~/.ray/auth_token onto the nodes")
    return out


def _types(cfg: dict[str, Any]) -> dict[str, Any]:
    return cfg.get("available_node_types", {}) or {}


def _access_problems(cfg: dict[str, Any], where: str) -> list[str]:
    out = []
    if cfg.get("provider", {}).get("use_internal_ips") is not True:
        out.append(f"{where}: provider.use_internal_ips must be true (the nodes have no public address)")
    proxy = cfg.get("auth", {}).get("ssh_proxy_command", "")
    if not proxy:
        out.append(f"{where}: auth.ssh_proxy_command is not set; SSH must go through a bastion or IAP")
    elif cfg["provider"].get("type") == "gcp" and not re.search(r"start-iap-tunnel|--tunnel-through-iap", proxy):
        out.append(f"{where}: auth.ssh_proxy_command `{proxy}` does not go through IAP")
    return out


def _public_rules(rules: list[dict[str, Any]]) -> list[str]:
    found = []
    for rule in rules:
        cidrs = [r.get("CidrIp") for r in rule.get("IpRanges", [])]
        cidrs += [r.get("CidrIpv6") for r in rule.get("Ipv6Ranges", [])]
        for cidr in (c for c in cidrs if c in PUBLIC):
            found.append(f"{rule.get('IpProtocol')} {rule.get('FromPort')}-{rule.get('ToPort')} from {cidr}")
    return found


def aws_network_problems(cfg: dict[str, Any], where: str) -> list[str]:
    """Public IPs and security groups Ray's AWS bootstrap would give the nodes of ``cfg``."""
    configure_interfaces = ray_private.aws_network_interfaces()
    default_rules = ray_private.aws_default_inbound_rules()
    out = []
    for key, node_type in _types(cfg).items():
        node_config = node_type.get("node_config", {})
        if "LaunchTemplate" in node_config:
            out.append(f"{where}: node type {key}: a LaunchTemplate's network cannot be checked offline")
        nics = node_config.get("NetworkInterfaces", [])
        if not nics or any(nic.get("AssociatePublicIpAddress") is not False for nic in nics):
            out.append(
                f"{where}: node type {key}: may get a public IP; give NetworkInterfaces with "
                "AssociatePublicIpAddress: false (otherwise the subnet's default decides)"
            )
        if any(nic.get("Ipv6AddressCount") or nic.get("Ipv6Addresses") for nic in nics):
            out.append(f"{where}: node type {key}: gets a globally routable IPv6 address")
    try:
        network = configure_interfaces(cfg)
    except ValueError as err:
        return out + [f"{where}: {err} (Ray's NetworkInterfaces check)"]
    # The selection Ray's _configure_security_group makes before it creates and fills a group.
    created = sorted(k for k, t in _types(network).items() if "SecurityGroupIds" not in t["node_config"])
    if created:
        extra = cfg["provider"].get("security_group", {}).get("IpPermissions", [])
        opened = _public_rules(default_rules(["sg-created-by-ray"], extra))
        out.append(
            f"{where}: node types {', '.join(created)} name no existing security group, so Ray creates one "
            f"whose rules open {'; '.join(opened) or 'what provider.security_group lists'}; "
            "give every node type its group by id (NetworkInterfaces Groups)"
        )
    return out


class _OfflineCompute:
    """Stands in for GCP's Compute client: Ray's ``_configure_subnet`` asks it for the region's
    subnets only when a node type names no network interface, and then gives that node type an
    interface on the first one with an external IP (ONE_TO_ONE_NAT)."""

    def __init__(self, region: str):
        self.region = region

    def subnetworks(self) -> _OfflineCompute:
        return self

    def list(self, **_: Any) -> _OfflineCompute:
        return self

    def execute(self) -> dict[str, Any]:
        return {"items": [{"selfLink": f"regions/{self.region}/subnetworks/default"}]}


def gcp_network_problems(cfg: dict[str, Any], where: str) -> list[str]:
    """External IPs Ray's GCP bootstrap would give the nodes of ``cfg`` (Ray adds no firewall rule)."""
    configure_subnet = ray_private.gcp_configure_subnet()
    network = configure_subnet(cfg, _OfflineCompute(cfg["provider"].get("region", "")))
    out = []
    for key, node_type in _types(network).items():
        node_config = node_type["node_config"]
        for i, nic in enumerate(node_config.get("networkInterfaces", [])):
            if nic.get("accessConfigs") or nic.get("ipv6AccessConfigs"):
                source = "as written" if "networkInterfaces" in _types(cfg)[key]["node_config"] else "Ray's default"
                out.append(
                    f"{where}: node type {key}: networkInterfaces[{i}] has accessConfigs ({source}): an external IP; "
                    "give networkInterfaces without accessConfigs"
                )
        if node_config.get("networkConfig", {}).get("enableExternalIps"):
            out.append(f"{where}: node type {key}: networkConfig.enableExternalIps gives the TPU an external IP")
    return out


def launcher_problems(cfg: dict[str, Any], where: str) -> list[str]:
    """Schema errors and security problems of a Ray cluster-launcher config, as Ray fills it in."""
    out = _schema_problems(cfg, where)
    try:
        effective = effective_config(cfg)
    except ray_private.Missing as err:  # this Ray cannot judge it: said, never passed
        return out + [f"{where}: cannot be judged as `ray up` runs it: {err}"]
    except Exception as err:  # anything Ray's own preparation refuses
        if not out:
            out.append(f"{where}: Ray's prepare_config/validate_config refuses it: {err}")
        effective = cfg
    out += _start_problems(effective, where) + _setup_problems(effective, where) + _head_problems(effective, where)
    provider = effective.get("provider", {}).get("type")
    if provider in ("aws", "gcp"):
        out += _access_problems(effective, where)
        checks = aws_network_problems if provider == "aws" else gcp_network_problems
        try:
            out += checks(effective, where)
        except ray_private.Missing as err:
            out.append(f"{where}: its network cannot be checked: {err}")
    else:
        out.append(f"{where}: provider.type {provider!r}: this lint knows the network of aws and gcp only")
    return out


# ----------------------------------------------------------------------- KubeRay


def _pod_specs(group: dict[str, Any]) -> dict[str, Any]:
    return group.get("template", {}).get("spec", {})


def _containers(spec: dict[str, Any]) -> list[dict[str, Any]]:
    return _pod_specs(spec).get("containers", [])


def _token_env_problems(container: dict[str, Any], where: str) -> list[str]:
    env = {e.get("name"): e for e in container.get("env", [])}
    out = []
    if env.get("RAY_AUTH_MODE", {}).get("value") != "token":
        out.append(f"{where}: container {container.get('name')} lacks RAY_AUTH_MODE=token")
    token = env.get("RAY_AUTH_TOKEN", {})
    if "secretKeyRef" not in token.get("valueFrom", {}):
        out.append(f"{where}: container {container.get('name')} must take RAY_AUTH_TOKEN from a Secret")
    return out


def _pod_problems(pod: dict[str, Any], where: str) -> list[str]:
    out = [f"{where}: hostNetwork puts Ray's ports on the node's address"] if pod.get("hostNetwork") else []
    for c in pod.get("initContainers", []) + pod.get("containers", []):
        problem = image_problem(str(c.get("image", "")), f"{where}: container {c.get('name')}")
        out += [problem] if problem else []
        if any("hostPort" in p for p in c.get("ports", [])):
            out.append(f"{where}: container {c.get('name')} maps a hostPort")
    return out


def _head_exposure(head: dict[str, Any], where: str) -> list[str]:
    out = []
    if head.get("serviceType", "ClusterIP") != "ClusterIP":
        out.append(
            f"{where}: head serviceType {head.get('serviceType')} exposes Ray's ports; use ClusterIP and port-forward"
        )
    service_type = head.get("headService", {}).get("spec", {}).get("type", "ClusterIP")
    if service_type != "ClusterIP":
        out.append(f"{where}: headService type {service_type} exposes Ray's ports (8265 among them)")
    if head.get("enableIngress"):
        out.append(f"{where}: head enableIngress creates an Ingress to the dashboard (8265)")
    # KubeRay's own default is 0.0.0.0: the file must say where the dashboard listens.
    if "dashboard-host" not in head.get("rayStartParams", {}):
        out.append(f"{where}: the head's rayStartParams leave dashboard-host to KubeRay's default (0.0.0.0); set it")
    return out


def raycluster_problems(spec: dict[str, Any], where: str) -> list[str]:
    """Security problems of a RayCluster's spec (also a RayJob's rayClusterSpec)."""
    head = spec.get("headGroupSpec", {})
    out = _head_exposure(head, where)
    if str(head.get("rayStartParams", {}).get("num-cpus")) != "0":
        out.append(f"{where}: the head must start with num-cpus '0' (no training worker on it)")
    groups = [("head", head)] + [(g.get("groupName"), g) for g in spec.get("workerGroupSpecs", [])]
    for name, group in groups:
        out += _pod_problems(_pod_specs(group), f"{where}: group {name}")
        for c in _containers(group):
            out += _token_env_problems(c, f"{where}: group {name}")
        for c in _containers(group) if name != "head" else []:
            gpus = str(group.get("rayStartParams", {}).get("num-gpus", "0"))
            limit = str(c.get("resources", {}).get("limits", {}).get("nvidia.com/gpu", "0"))
            if gpus != limit:
                out.append(f"{where}: group {name}: num-gpus {gpus} but the container's GPU limit is {limit}")
    return out


def kuberay_problems(doc: dict[str, Any], where: str) -> list[str]:
    """Security problems of a KubeRay RayCluster or RayJob manifest (or a Service or Ingress beside one)."""
    kind = doc.get("kind")
    spec = doc.get("spec", {})
    if kind == "RayCluster":
        return raycluster_problems(spec, where)
    if kind == "RayJob":
        pod = spec.get("submitterPodTemplate", {}).get("spec", {})
        out = _pod_problems(pod, f"{where}: submitter")
        for c in pod.get("containers", []):
            out += _token_env_problems(c, f"{where}: submitter")
        if "rayClusterSpec" in spec:
            out += raycluster_problems(spec["rayClusterSpec"], f"{where}: rayClusterSpec")
        return out
    if kind == "Service":
        service_type = spec.get("type", "ClusterIP")
        return [] if service_type == "ClusterIP" else [f"{where}: Service type {service_type} exposes its ports"]
    if kind == "Ingress":
        return [f"{where}: an Ingress exposes the cluster's services outside the cluster"]
    return [f"{where}: unexpected kind {kind!r}"]


# ----------------------------------------------------------------------- Dockerfile


def dockerfile_problems(text: str, where: str) -> list[str]:
    """Base images that are not pinned and a package install that does not pin torch."""
    out = []
    for line in text.splitlines():
        words = line.split()
        if words and words[0].upper() == "FROM":
            image = next(w for w in words[1:] if not w.startswith("--"))
            problem = image_problem(image, f"{where}: FROM")
            out += [problem] if problem else []
    installs = [line for line in text.splitlines() if "pip install" in line]
    if installs and not any(TORCH_PIN.search(line) for line in installs):
        out.append(f"{where}: no pip install pins torch to an exact version (torch==X.Y.Z)")
    return out


def problems(path: str | Path) -> list[str]:
    """Everything wrong with one file of ``clusters/`` (an empty list: it passed)."""
    p = Path(path)
    text = p.read_text()
    out = _secrets(text, p.name) + _public_ranges(text, p.name)
    if p.name.startswith("Dockerfile"):
        return out + dockerfile_problems(text, p.name)
    docs = [d for d in yaml.safe_load_all(text) if d]
    for i, doc in enumerate(docs):
        where = p.name if len(docs) == 1 else f"{p.name}[{i}]"
        if "apiVersion" in doc:
            out += kuberay_problems(doc, where)
        else:
            out += launcher_problems(doc, where)
    return out


def main(argv: list[str] | None = None) -> int:
    """``python -m raytrain_loops.tools.check_clusters [FILE ...]``: every problem of each file (all
    of ``clusters/`` when none is named), one a line; exit status 1 when there is any."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m raytrain_loops.tools.check_clusters", description=main.__doc__)
    parser.add_argument("files", nargs="*", help="cluster YAMLs, KubeRay manifests, Dockerfiles (default: clusters/)")
    args = parser.parse_args(argv)
    files = args.files or sorted(
        str(p) for p in Path("clusters").rglob("*") if p.suffix in (".yaml", ".yml") or p.name.startswith("Dockerfile")
    )
    if not files:
        parser.error("no files named and no cluster files under ./clusters")
    failed = 0
    for f in files:
        found = problems(f)
        for problem in found:
            print(problem)
        print(f"{f}: {len(found)} problem(s)" if found else f"{f}: ok", file=sys.stderr)
        failed += bool(found)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
