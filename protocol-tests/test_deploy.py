"""The cluster deployment files (examples/cluster/), checked offline: the Kubernetes manifests
against the API's JSON schemas (kubernetes-validate, strict), the compose file by
docker-compose itself, every `serve` flag, config key and KERNEL_BROKER_* variable they use
against the real binary's `serve --help`, and each node's advertise URL against its listen
port. Neither validator is optional: a missing one fails the test (scripts/setup --test
installs both).
"""
import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import yaml

from conftest import REPO

CLUSTER = REPO / "examples/cluster"
K8S = CLUSTER / "kubernetes"
COMPOSE = CLUSTER / "compose.yaml"
BROKER_DOCKERFILE = REPO / "docker/broker/Dockerfile"
# The oldest Kubernetes the manifests are for (securityContext.appArmorProfile is 1.30) and
# the newest schema kubernetes-validate bundles.
K8S_VERSIONS = ["1.30.0", "1.37.0"]


def manifest_files():
    files = sorted(K8S.rglob("*.yaml"))
    assert files, f"no manifests under {K8S}"
    return files


def documents(path):
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


def kubernetes_validate():
    exe = Path(sys.executable).parent / "kubernetes-validate"
    if not exe.exists():
        pytest.fail(f"kubernetes-validate is not installed next to {sys.executable}: "
                    "pip install -r protocol-tests/requirements.txt (scripts/setup --test)")
    return str(exe)


def docker_compose():
    exe = shutil.which("docker-compose")
    if exe is None:
        pytest.fail("docker-compose is not installed: apt-get install docker-compose "
                    "(scripts/setup --test)")
    return exe


def run(cmd, **kw):
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, **kw)


# --- the validators ---------------------------------------------------------------------

@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_kubernetes_manifests_are_valid(version):
    files = manifest_files()
    r = run([kubernetes_validate(), "--strict", "-k", version, *map(str, files)])
    out = r.stdout + r.stderr
    assert r.returncode == 0, out
    # One "passed" line per resource: none skipped as unknown, none failed.
    resources = sum(len(documents(f)) for f in files)
    assert out.count(" passed ") == resources, out
    assert "fail" not in out.lower() and "WARN" not in out, out


def test_kubernetes_validate_rejects_a_broken_manifest(tmp_path):
    """The validator is not a no-op: a field of the wrong type, and an unknown one
    (--strict), are refused."""
    text = (K8S / "statefulset.yaml").read_text()
    assert "  replicas: 3\n" in text and "terminationGracePeriodSeconds: 900" in text
    wrong_type = tmp_path / "wrong-type.yaml"
    wrong_type.write_text(text.replace("  replicas: 3\n", "  replicas: three\n"))
    unknown = tmp_path / "unknown-field.yaml"
    unknown.write_text(text.replace("terminationGracePeriodSeconds: 900",
                                    "terminationGracePeriod: 900"))
    for broken in (wrong_type, unknown):
        r = run([kubernetes_validate(), "--strict", "-k", K8S_VERSIONS[-1], str(broken)])
        assert r.returncode != 0, f"{broken.name} passed:\n{r.stdout}{r.stderr}"


def test_compose_file_is_valid():
    r = run([docker_compose(), "-f", str(COMPOSE), "config", "-q"], cwd=CLUSTER)
    assert r.returncode == 0, r.stdout + r.stderr


def test_docker_compose_rejects_a_broken_compose_file(tmp_path):
    broken = tmp_path / "compose.yaml"
    text = COMPOSE.read_text()
    assert "  mem_limit: 4g\n" in text
    broken.write_text(text.replace("  mem_limit: 4g\n", "  mem_limit: 4g\n  no_such_key: 1\n"))
    r = run([docker_compose(), "-f", str(broken), "config", "-q"], cwd=tmp_path)
    assert r.returncode != 0, r.stdout + r.stderr


# --- what the files ask of the broker ---------------------------------------------------

def broker_binary():
    binary = os.environ.get("KERNEL_BROKER_BIN", str(REPO / "target/debug/kernel-broker"))
    if not os.access(binary, os.X_OK):
        pytest.fail(f"no broker binary at {binary} (cargo build --bins, or set KERNEL_BROKER_BIN)")
    return binary


@pytest.fixture(scope="module")
def serve_help():
    r = run([broker_binary(), "serve", "--help"])
    assert r.returncode == 0, r.stderr
    flags = set(re.findall(r"^\s+(?:-\w, )?(--[a-z][a-z0-9-]*)", r.stdout, re.M))
    envs = set(re.findall(r"\[env: (KERNEL_BROKER_[A-Z0-9_]+)", r.stdout))
    assert {"--listen", "--advertise-url", "--node-id", "--database-url"} <= flags, r.stdout
    assert "KERNEL_BROKER_DATABASE_URL" in envs, r.stdout
    return flags, envs


def parse_serve_args(argv):
    """{flag: value} of a `kernel-broker serve ...` argument list (`--f=v` or `--f v`)."""
    assert argv[:2] == ["kernel-broker", "serve"], argv
    args, rest = {}, list(argv[2:])
    while rest:
        word = rest.pop(0)
        assert word.startswith("--"), f"not a flag: {word!r} in {argv}"
        if "=" in word:
            name, value = word.split("=", 1)
        elif rest and not rest[0].startswith("--"):
            name, value = word, rest.pop(0)
        else:
            name, value = word, None
        assert name not in args, f"{name} given twice in {argv}"
        args[name] = value
    return args


def resources(kind):
    """The broker's resources of a kind (not the example PostgreSQL's)."""
    return [d for f in manifest_files() for d in documents(f) if d["kind"] == kind
            and d["metadata"]["name"].startswith("kernel-broker")]


def statefulset():
    (sts,) = resources("StatefulSet")
    return sts


def broker_container():
    (c,) = [c for c in statefulset()["spec"]["template"]["spec"]["containers"]
            if c["name"] == "broker"]
    return c


def compose_brokers():
    services = yaml.safe_load(COMPOSE.read_text())["services"]
    brokers = {name: s for name, s in services.items() if name.startswith("broker-")}
    assert len(brokers) == 3, list(services)
    return brokers


def configmap_keys():
    (cm,) = resources("ConfigMap")
    return list(tomllib.loads(cm["data"]["config.toml"]))


def test_every_flag_config_key_and_variable_exists(serve_help):
    flags, envs = serve_help
    uses = [("statefulset.yaml", broker_container()["args"])]
    uses += [(f"compose.yaml {name}", s["command"]) for name, s in compose_brokers().items()]
    for where, argv in uses:
        for flag in parse_serve_args(argv):
            assert flag in flags, f"{where}: kernel-broker serve has no {flag}"
    for key in configmap_keys():
        assert "--" + key.replace("_", "-") in flags, f"configmap.yaml: no setting {key}"
    variables = {e["name"] for e in broker_container()["env"]}
    for s in compose_brokers().values():
        variables |= set(s["environment"])
    variables |= set(re.findall(r"\b(KERNEL_BROKER_[A-Z0-9_]+)=", BROKER_DOCKERFILE.read_text()))
    for var in sorted(v for v in variables if v.startswith("KERNEL_BROKER_")):
        assert var in envs, f"kernel-broker serve reads no {var}"


def port(address):
    return int(address.rsplit(":", 1)[1])


def test_each_node_advertises_its_listen_port_and_name():
    # Kubernetes: the pod's stable name through the headless Service.
    sts = statefulset()
    c = broker_container()
    args = parse_serve_args(c["args"])
    advertise = urlsplit(args["--advertise-url"])
    assert advertise.scheme == "http"
    assert advertise.port == port(args["--listen"])
    assert [p["containerPort"] for p in c["ports"]] == [advertise.port]
    # (netloc: .hostname would lowercase the $(VAR)s)
    assert advertise.netloc.rsplit(":", 1)[0] == (f"$(POD_NAME).{sts['spec']['serviceName']}"
                                  ".$(POD_NAMESPACE).svc.cluster.local")
    assert args["--node-id"] == "$(POD_NAME)"
    fields = {e["name"]: e.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath")
              for e in c["env"]}
    assert fields["POD_NAME"] == "metadata.name"
    assert fields["POD_NAMESPACE"] == "metadata.namespace"
    services = {d["metadata"]["name"]: d for d in resources("Service")}
    assert len(services) == 2, list(services)
    headless = services[sts["spec"]["serviceName"]]["spec"]
    assert headless["clusterIP"] == "None"
    # A draining pod is not ready, and its peers must still resolve its name.
    assert headless["publishNotReadyAddresses"] is True
    for svc in services.values():
        assert [p["targetPort"] for p in svc["spec"]["ports"]] == [c["ports"][0]["name"]]

    # Compose: each service by its name on the compose network; one published port each.
    published = set()
    for name, s in compose_brokers().items():
        args = parse_serve_args(s["command"])
        advertise = urlsplit(args["--advertise-url"])
        assert advertise.hostname == name, (name, args)
        assert advertise.port == port(args["--listen"]), (name, args)
        assert args["--node-id"] == name
        (mapping,) = s["ports"]
        host_port, container_port = mapping.rsplit(":", 2)[-2:]
        assert int(container_port) == advertise.port, (name, mapping)
        published.add(host_port)
    assert len(published) == 3


def test_drain_hook_and_probes():
    """preStop drains with SIGUSR1 and waits, within the grace period; readiness is
    /healthz (503 while draining), liveness is not (a draining node must not be killed)."""
    spec = statefulset()["spec"]["template"]["spec"]
    c = broker_container()
    hook = " ".join(c["lifecycle"]["preStop"]["exec"]["command"])
    assert "kill -USR1 1" in hook
    (wait,) = re.findall(r'-lt (\d+)', hook)
    assert int(wait) + 30 <= spec["terminationGracePeriodSeconds"]
    assert c["readinessProbe"]["httpGet"]["path"] == "/healthz"
    assert "httpGet" not in c["livenessProbe"]


def test_kernel_image_hash_ignores_docker_broker(tmp_path):
    """docker/build-offline.sh's inputs hash (the kernel image's label, compared by
    .ci/docker-setup.sh) does not change with the broker image's files."""
    (tmp_path / "kernels").mkdir()
    shutil.copytree(REPO / "docker", tmp_path / "docker")
    shutil.copy(REPO / "kernels/requirements.txt", tmp_path / "kernels")
    # The kernel specs whose files the image holds (issue 38).
    for name in ("bash", "sql", "javascript", "java", "r"):
        shutil.copytree(REPO / "kernels" / name, tmp_path / "kernels" / name,
                        ignore=shutil.ignore_patterns("__pycache__"))
    script = tmp_path / "docker/build-offline.sh"

    def inputs_hash():
        r = run(["bash", str(script), "--print-hash"])
        assert r.returncode == 0, r.stderr
        return r.stdout.strip()

    before = inputs_hash()
    (tmp_path / "docker/broker/extra").write_text("not an input of the kernel image\n")
    assert inputs_hash() == before
    (tmp_path / "docker/extra").write_text("an input of the kernel image\n")
    assert inputs_hash() != before
    changed = inputs_hash()
    (tmp_path / "kernels/sql/kernel.json").write_text("{}\n")
    assert inputs_hash() != changed
