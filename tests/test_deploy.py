"""deploy/: the Kubernetes manifests agree with each other and with the CLI; the Dockerfile builds
what the manifests run. No cluster here: the manifests are parsed and cross-checked, and every
command a pod runs is parsed by the real `mesh` argument parser with the pod's environment."""

from __future__ import annotations

import re
import shlex
from pathlib import Path
from typing import Any

import pytest
import yaml

from mesh.cli import parser

ROOT = Path(__file__).resolve().parent.parent
K8S = ROOT / "deploy" / "k8s"


def docs() -> list[dict[str, Any]]:
    out = []
    for f in sorted(K8S.glob("*.yaml")):
        out += [d for d in yaml.safe_load_all(f.read_text()) if d]
    return out


DOCS = docs()


def kind(k: str) -> list[dict[str, Any]]:
    return [d for d in DOCS if d["kind"] == k]


def workloads() -> list[dict[str, Any]]:
    return kind("Deployment") + kind("StatefulSet")


def by_name(k: str, name: str) -> dict[str, Any]:
    (d,) = [d for d in kind(k) if d["metadata"]["name"] == name]
    return d


def container(w: dict[str, Any]) -> dict[str, Any]:
    (c,) = w["spec"]["template"]["spec"]["containers"]
    return c


def env_of(w: dict[str, Any], ordinal: int = 0) -> dict[str, str]:
    """The container's environment as Kubernetes would give it (downward API values stand in)."""
    c = container(w)
    env: dict[str, str] = {"HOSTNAME": f"{w['metadata']['name']}-{ordinal}"}
    for src in c.get("envFrom", []):
        if "configMapRef" in src:
            env.update(by_name("ConfigMap", src["configMapRef"]["name"])["data"])
        if "secretRef" in src:
            env.update(by_name("Secret", src["secretRef"]["name"])["stringData"])
    for e in c.get("env", []):
        if "value" in e:
            env[e["name"]] = re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], e["value"])
        elif "secretKeyRef" in e["valueFrom"]:
            ref = e["valueFrom"]["secretKeyRef"]
            env[e["name"]] = by_name("Secret", ref["name"])["stringData"][ref["key"]]
        else:
            path = e["valueFrom"]["fieldRef"]["fieldPath"]
            env[e["name"]] = {"metadata.name": env["HOSTNAME"], "status.podIP": f"10.0.0.{ordinal + 10}"}[path]
    return env


def mesh_argv(w: dict[str, Any], ordinal: int = 0) -> list[str]:
    """The `mesh` command line a pod runs: k8s `$(VAR)` expansion of args, or the shell script's
    `exec mesh ...` line for this ordinal, with its variables expanded."""
    c, env = container(w), env_of(w, ordinal)
    if c.get("command") == ["/bin/sh", "-c"]:
        script = c["args"][0]
        branch = script.split("else")[0 if ordinal == 0 else 1]
        line = next(x.strip() for x in branch.splitlines() if x.strip().startswith("exec mesh "))
        env["ORDINAL"] = str(ordinal)
        line = re.sub(r"\$\{?(\w+)\}?", lambda m: env[m.group(1)], line)
        return shlex.split(line)[2:]
    assert "command" not in c  # the image's ENTRYPOINT is `mesh`
    for a in c["args"]:
        for var in re.findall(r"\$\((\w+)\)", a):
            assert var in env, f"{w['metadata']['name']}: $({var}) is not in the container's environment"
    return [re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], a) for a in c["args"]]


def test_every_workload_selects_its_own_pods():
    for w in workloads():
        sel = w["spec"]["selector"]["matchLabels"]
        labels = w["spec"]["template"]["metadata"]["labels"]
        assert sel.items() <= labels.items(), w["metadata"]["name"]


def test_every_service_selects_pods_that_have_its_ports():
    for svc in kind("Service"):
        sel = svc["spec"]["selector"]
        pods = [w for w in workloads() if sel.items() <= w["spec"]["template"]["metadata"]["labels"].items()]
        assert pods, f"service {svc['metadata']['name']} selects no workload"
        for w in pods:
            ports = container(w)["ports"]
            names = {p["name"] for p in ports}
            numbers = {p["containerPort"] for p in ports}
            for sp in svc["spec"]["ports"]:
                t = sp.get("targetPort", sp["port"])
                assert (t in names) if isinstance(t, str) else (t in numbers), (svc["metadata"]["name"], t)


def test_statefulsets_have_their_headless_service():
    for s in kind("StatefulSet"):
        svc = by_name("Service", s["spec"]["serviceName"])
        assert svc["spec"].get("clusterIP") == "None"
        assert svc["spec"]["selector"].items() <= s["spec"]["template"]["metadata"]["labels"].items()


def test_probes_use_declared_ports():
    for w in workloads():
        c = container(w)
        names = {p["name"] for p in c["ports"]}
        for probe in ("readinessProbe", "livenessProbe"):
            if probe in c:
                assert c[probe]["httpGet"]["port"] in names, (w["metadata"]["name"], probe)


def test_etcd_is_three_members_that_name_each_other():
    sts = by_name("StatefulSet", "etcd")
    assert sts["spec"]["replicas"] == 3
    env = {e["name"]: e.get("value") for e in container(sts)["env"]}
    svc, peer = sts["spec"]["serviceName"], next(p["containerPort"] for p in container(sts)["ports"]
                                                  if p["name"] == "peer")
    want = ",".join(f"etcd-{i}=https://etcd-{i}.{svc}:{peer}" for i in range(3))
    assert env["ETCD_INITIAL_CLUSTER"] == want


def test_every_etcd_endpoint_is_a_member_client_url():
    sts = by_name("StatefulSet", "etcd")
    client = next(p["containerPort"] for p in container(sts)["ports"] if p["name"] == "client")
    members = {f"https://etcd-{i}.{sts['spec']['serviceName']}:{client}" for i in range(sts["spec"]["replicas"])}
    for w in workloads():
        if w["metadata"]["name"] == "etcd":
            continue
        a = parser().parse_args(mesh_argv(w))
        assert set(a.etcd.split(",")) == members, w["metadata"]["name"]


def test_mesh_is_two_replicas_behind_a_service_on_its_port():
    dep = by_name("Deployment", "atomesh-mesh")
    assert dep["spec"]["replicas"] == 2
    a = parser().parse_args(mesh_argv(dep))
    assert a.cmd == "serve" and a.host == "0.0.0.0"
    assert a.port == next(p["containerPort"] for p in container(dep)["ports"] if p["name"] == "http")
    assert a.mesh_id == "atomesh-mesh-0" and a.advertise_url == f"http://10.0.0.10:{a.port}"


def test_prefill_pipeline_is_one_pod_per_stage():
    sts = by_name("StatefulSet", "prefill-p0")
    pp = sts["spec"]["replicas"]
    ports = {p["name"]: p["containerPort"] for p in container(sts)["ports"]}
    head = parser().parse_args(mesh_argv(sts, 0))
    assert head.cmd == "prefill" and head.pp_size == pp == int(env_of(sts)["PP_SIZE"])
    assert head.port == ports["http"] and head.remote_stages == ports["store"]
    assert head.host == env_of(sts, 0)["POD_IP"]  # binds and advertises the pod's address
    for r in range(1, pp):
        st = parser().parse_args(mesh_argv(sts, r))
        assert st.cmd == "stage" and st.pp_rank == r and st.host == env_of(sts, r)["POD_IP"]
        host, port = st.head.rsplit(":", 1)
        assert host == f"{sts['metadata']['name']}-0.{sts['spec']['serviceName']}"  # pod 0 via the headless service
        assert int(port) == head.remote_stages
        assert ports[f"ctrl-{r}"] == head.remote_stages + r  # stage r's control socket on the head
        assert st.checkpoint == head.checkpoint


def test_decode_engines_enroll_and_serve_on_their_port():
    sts = by_name("StatefulSet", "decode")
    a = parser().parse_args(mesh_argv(sts))
    assert a.cmd == "decode" and a.port == next(p["containerPort"] for p in container(sts)["ports"])
    assert container(sts)["resources"]["limits"]["nvidia.com/gpu"] == a.tp_size
    assert a.id == "decode-0" and a.host == "10.0.0.10"


def test_engine_pods_mount_the_models_claim_at_the_checkpoint_path():
    claim = kind("PersistentVolumeClaim")[0]["metadata"]["name"]
    for name in ("prefill-p0", "decode"):
        w = by_name("StatefulSet", name)
        vols = {v["name"]: v for v in w["spec"]["template"]["spec"]["volumes"]}
        (m,) = [m for m in container(w)["volumeMounts"] if "persistentVolumeClaim" in vols[m["name"]]]
        assert vols[m["name"]]["persistentVolumeClaim"]["claimName"] == claim
        assert parser().parse_args(mesh_argv(w)).checkpoint.startswith(m["mountPath"] + "/")


def test_images_and_dockerfile_agree():
    text = (ROOT / "deploy" / "Dockerfile").read_text()
    assert 'ENTRYPOINT ["mesh"]' in text and "torch==2.13.0" in text and "libibverbs1" in text
    for sub in ("mesh", "policies", "workers", "demo"):
        assert f"COPY {sub} {sub}" in text
    exposed = {int(p) for p in re.search(r"^EXPOSE (.+)$", text, re.M).group(1).split()}
    for w in workloads():
        c = container(w)
        if c["image"].startswith("atomesh"):
            assert {p["containerPort"] for p in c["ports"] if not p["name"].startswith("ctrl")} <= exposed


def test_etcd_speaks_tls_and_each_client_logs_in_as_its_role():
    """etcd serves clients and peers over TLS (the etcd-tls Secret); the etcd-auth Job creates the
    users (workers write their own keys, meshes read: tests/test_etcd_auth.py runs the same command
    against a real etcd); the mesh logs in as atomesh-mesh, every worker pod as atomesh-worker,
    each with the CA mounted where --etcd-ca points."""
    sts = by_name("StatefulSet", "etcd")
    env = {e["name"]: e.get("value") for e in container(sts)["env"]}
    assert all(env[k].startswith("https://") for k in ("ETCD_LISTEN_CLIENT_URLS", "ETCD_LISTEN_PEER_URLS",
                                                          "ETCD_ADVERTISE_CLIENT_URLS"))
    assert env["ETCD_PEER_CLIENT_CERT_AUTH"] == "true" and "ETCD_TRUSTED_CA_FILE" not in env
    tls_vol = {v["name"]: v for v in sts["spec"]["template"]["spec"]["volumes"]}
    assert any(v.get("secret", {}).get("secretName") == "etcd-tls" for v in tls_vol.values())
    (job,) = kind("Job")
    jc = job["spec"]["template"]["spec"]["containers"][0]
    jenv = {**by_name("ConfigMap", "atomesh-config")["data"], **by_name("Secret", "atomesh-etcd-users")["stringData"]}
    ja = parser().parse_args([re.sub(r"\$\((\w+)\)", lambda m: jenv[m.group(1)], x) for x in jc["args"]])
    assert ja.cmd == "etcd-auth" and (ja.mesh_user, ja.worker_user) == ("atomesh-mesh", "atomesh-worker")
    assert {"ATOMESH_ETCD_ROOT_PASSWORD", "ATOMESH_ETCD_MESH_PASSWORD", "ATOMESH_ETCD_WORKER_PASSWORD"} <= set(jenv)
    for w, user in ((by_name("Deployment", "atomesh-mesh"), "atomesh-mesh"),
                    (by_name("StatefulSet", "decode"), "atomesh-worker"),
                    (by_name("StatefulSet", "prefill-p0"), "atomesh-worker")):
        e = env_of(w)
        assert e["ATOMESH_ETCD_USER"] == user and len(e["ATOMESH_ETCD_PASSWORD"]) >= 12, w["metadata"]["name"]
        a = parser().parse_args(mesh_argv(w))
        vols = {v["name"]: v for v in w["spec"]["template"]["spec"]["volumes"]}
        mounts = [m for m in container(w)["volumeMounts"] if vols[m["name"]].get("secret", {}).get("secretName")
                  == "etcd-tls"]
        assert mounts and a.etcd_ca == mounts[0]["mountPath"] + "/ca.crt", w["metadata"]["name"]


@pytest.mark.parametrize("name", ["prefill-p0", "decode", "atomesh-mesh"])
def test_pods_reference_only_defined_config(name):
    w = next(x for x in workloads() if x["metadata"]["name"] == name)
    env_of(w)  # raises KeyError on a $(VAR) or configMap / secret that does not exist


def test_network_policies_cover_every_workload_and_keep_workers_to_their_peers():
    """Every pod is selected by an ingress NetworkPolicy; a worker pod (whose KV ports are random and,
    with Mooncake, listen on every interface) admits only the mesh and Atomesh workers; etcd only
    Atomesh pods; the mesh only its HTTP port."""
    pols = kind("NetworkPolicy")

    def policies_of(labels: dict[str, str]) -> list[dict[str, Any]]:
        return [p for p in pols if all(labels.get(k) == v for k, v in p["spec"]["podSelector"]["matchLabels"].items())]

    allowed_peers = {"mesh", "prefill", "decode"}
    for w in workloads():
        labels = w["spec"]["template"]["metadata"]["labels"]
        (pol,) = policies_of(labels)
        assert pol["spec"]["policyTypes"] == ["Ingress"]
        comp = labels["app.kubernetes.io/component"]
        rules = pol["spec"]["ingress"]
        if comp in ("prefill", "decode"):
            for r in rules:
                peers = {f["podSelector"]["matchLabels"].get("app.kubernetes.io/component") for f in r["from"]}
                assert peers <= allowed_peers and None not in peers, peers
        elif comp == "mesh":
            assert all("from" not in r and [p["port"] for p in r["ports"]] == [8000] for r in rules)
        elif comp == "etcd":
            assert all(r["from"] and r["ports"] for r in rules)
