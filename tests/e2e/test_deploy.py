"""Deploy artifacts are checked, not trusted: the Kustomize overlays render and every object validates against the
Kubernetes JSON schemas (kubernetes-validate, strict: unknown fields are errors); the config and policies they carry
load in the gateway; the compose file, the Dockerfile, the dashboard and the SGLang recipes name only things that
exist (files in this repo, public images, metrics the gateway exports, the flags the issue requires)."""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from gateway.cli import build_parser
from gateway.config import load_config, parse_config
from gateway.observability.metrics import GatewayMetrics
from gateway.tenancy.policy_loader import load_policies, parse_policies

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
K8S_VERSIONS = ("1.30.0", "1.37.0")  # oldest still common, newest the validator ships
CRDS = {"ServiceMonitor": "monitoring.coreos.com/v1"}


def render(overlay: str) -> list[dict[str, Any]]:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl (with its built-in kustomize) is not installed on this machine")
    out = subprocess.run([kubectl, "kustomize", str(DEPLOY / "k8s" / "overlays" / overlay)], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def by_kind(docs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] == kind]


def test_the_validator_rejects_what_kubernetes_would():
    """Control: a misspelt field and a wrong type are errors, so a green run below means something."""
    bad = {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "x"},
           "spec": {"replicas": "two", "selector": {"matchLabels": {"a": "b"}},
                    "template": {"metadata": {"labels": {"a": "b"}}, "spec": {"containers": [{"name": "c", "imagePull": "x"}]}}}}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, "1.37.0", strict=True)


@pytest.mark.parametrize("overlay", ["dev", "prod"])
def test_overlays_render_and_validate_against_the_kubernetes_schemas(overlay):
    docs = render(overlay)
    kinds = {d["kind"] for d in docs}
    assert {"Deployment", "Service", "HorizontalPodAutoscaler", "PodDisruptionBudget", "ConfigMap", "ServiceMonitor"} <= kinds
    for d in docs:
        if d["kind"] in CRDS:
            assert d["apiVersion"] == CRDS[d["kind"]]
            continue
        for v in K8S_VERSIONS:
            kubernetes_validate.validate(d, v, strict=True)

    (dep,) = [d for d in by_kind(docs, "Deployment") if d["metadata"]["name"] == "inference-gateway"]
    pod = dep["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    assert c["readinessProbe"]["httpGet"]["path"] == "/readyz" and c["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert pod["securityContext"]["runAsNonRoot"] and c["securityContext"]["readOnlyRootFilesystem"]
    assert pod["terminationGracePeriodSeconds"] > int(c["args"][c["args"].index("--drain-timeout") + 1])
    # every ConfigMap the pod mounts is in the render; so is the Secret in dev (prod: created by the platform)
    cms = {d["metadata"]["name"]: d for d in by_kind(docs, "ConfigMap")}
    mounted = {v["configMap"]["name"] for v in pod["volumes"] if "configMap" in v}
    assert mounted <= set(cms)
    if overlay == "dev":
        assert {s["metadata"]["name"] for s in by_kind(docs, "Secret")} == {"gateway-secrets"}
        # the bundled Redis holds the budget ledgers: an AOF on a claimed volume, so a restarted pod keeps them
        (redis,) = [d for d in by_kind(docs, "Deployment") if d["metadata"]["name"] == "gateway-redis"]
        rpod = redis["spec"]["template"]["spec"]
        args = rpod["containers"][0]["args"]
        assert args[args.index("--appendonly") + 1] == "yes" and "/data" in args
        claims = {v["persistentVolumeClaim"]["claimName"] for v in rpod["volumes"] if "persistentVolumeClaim" in v}
        assert claims and claims <= {d["metadata"]["name"] for d in by_kind(docs, "PersistentVolumeClaim")}
    (sm,) = by_kind(docs, "ServiceMonitor")
    assert sm["spec"]["endpoints"][0]["port"] in {p["name"] for s in by_kind(docs, "Service") for p in s["spec"]["ports"]}
    # the config and policies carried by the ConfigMaps load in the gateway, as the pod would load them
    config_cm = next(cm for n, cm in cms.items() if n.startswith("gateway-config"))
    cfg = parse_config(yaml.safe_load(config_cm["data"]["gateway.yaml"]), f"{overlay}: gateway-config")
    files = {"defaults.yaml": cms["gateway-policy-defaults"]["data"]["defaults.yaml"].encode()}
    files |= {f"tenants/{k}": v.encode() for k, v in cms["gateway-tenants"]["data"].items()}
    assert [t.name for t in parse_policies(files, "-", cfg, overlay).tenants] == ["demo"]
    assert cfg.policies.dir in {m["mountPath"] for m in c["volumeMounts"]}
    assert cfg.policies.tenants_dir in {m["mountPath"] for m in c["volumeMounts"]}
    env = {e["name"] for e in c["env"]}
    assert cfg.admin.token_hashes_env in env and all(p.api_key_env in env for p in cfg.pools if p.api_key_env)
    if cfg.routing.redis_password_env:  # prod: the password comes from the Secret, not the ConfigMap
        assert cfg.routing.redis_password_env in env and "@" not in (cfg.routing.redis_url or "")
    assert (overlay == "prod") == bool(cfg.routing.redis_password_env)
    # the admin Service isolates: it alone reaches the admin listener (admin API, /metrics), which the config binds
    # on the pod's address at the container's `admin` port; the client Service reaches the API port only, and
    # Prometheus scrapes through the admin Service
    services = {s["metadata"]["name"]: s for s in by_kind(docs, "Service")}
    client_svc, admin_svc = services["inference-gateway"], services["inference-gateway-admin"]
    assert [p["targetPort"] for p in client_svc["spec"]["ports"]] == ["http"]
    assert [p["targetPort"] for p in admin_svc["spec"]["ports"]] == ["admin"]
    assert admin_svc["spec"].get("type", "ClusterIP") == "ClusterIP"
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports["admin"] == cfg.admin.listen_port(ports["http"]) and cfg.admin.host == "0.0.0.0"
    assert ports["http"] == int(c["args"][c["args"].index("--port") + 1])
    labels = admin_svc["metadata"]["labels"]
    assert sm["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert not sm["spec"]["selector"]["matchLabels"].items() <= client_svc["metadata"]["labels"].items()
    assert sm["spec"]["endpoints"][0]["port"] == "admin" and sm["spec"]["endpoints"][0]["path"] == "/metrics"


def test_compose_names_only_files_in_this_repo_and_public_images():
    compose = yaml.safe_load((DEPLOY / "compose.yaml").read_text())
    for name, svc in compose["services"].items():
        image = svc["image"]
        if image == "inference-gateway:local":  # built here
            cmd = svc["command"]
            build_parser(cmd).parse_args(cmd)  # a real `gateway` subcommand with valid flags (SystemExit otherwise)
        else:  # public and pinned, never :latest
            assert re.fullmatch(r"[a-z0-9./-]+:v?[0-9][\w.-]*", image), f"{name}: {image}"  # v2.55.1: Prometheus' tags
        if "build" in svc:
            assert (DEPLOY / svc["build"]["context"] / svc["build"]["dockerfile"]).is_file()
        for vol in svc.get("volumes", []):
            src = vol.split(":")[0]
            assert (DEPLOY / src).exists() or src in (compose.get("volumes") or {}), f"{name}: {src}"
    assert {"redis", "sim-mi355x", "sim-b200", "gateway-1", "gateway-2", "otel-collector", "prometheus",
            "grafana"} <= set(compose["services"])
    redis = compose["services"]["redis"]  # budgets live in Redis: it persists (AOF) on a named volume
    assert redis["command"][redis["command"].index("--appendonly") + 1] == "yes"
    assert any(v.split(":")[0] in (compose.get("volumes") or {}) for v in redis["volumes"])
    assert all(p.startswith("127.0.0.1:") for s in compose["services"].values() for p in s.get("ports", []))
    # the config the gateways mount loads, with the policies directory mounted beside it
    cfg = load_config(DEPLOY / "compose" / "gateway.yaml")
    assert {t.name for t in load_policies(ROOT / "policies", cfg).tenants} == {"acme", "batch-jobs"}
    hosts = {u.split("//")[1].split(":")[0] for p in cfg.pools for u in [r.url for r in p.replicas]}
    assert hosts <= set(compose["services"]) and cfg.routing.redis_url.startswith("redis://redis:")


def test_dockerfile_is_non_root_with_a_health_check_and_copies_only_what_exists():
    text = (DEPLOY / "Dockerfile").read_text()
    for line in text.splitlines():
        if line.startswith("COPY") and "--from=" not in line:
            *srcs, _ = shlex.split(line)[1:]
            assert all((ROOT / s).exists() for s in srcs), line
    assert re.search(r"^USER 10001$", text, re.M) and "HEALTHCHECK" in text and "/healthz" in text
    assert re.search(r"^ARG PYTHON_IMAGE=python:3\.11-slim-\w+$", text, re.M)


def exported_metric_names() -> set[str]:
    """The series names Prometheus will see (labelled metrics have no samples until first used)."""
    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}
    return {fam.name + sfx for fam in GatewayMetrics().registry.collect() for sfx in suffixes[fam.type]}


def engine_metric_names() -> set[str]:
    """The `sglang:*` series a (simulated) SGLang server exports: the simulator follows real SGLang's names."""
    from gateway_lab.sim.metrics import ReplicaMetrics
    from gateway_lab.sim.profiles import profile
    from gateway_lab.sim.replica import Replica

    suffixes = {"counter": ("_total", ""), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}
    registry = ReplicaMetrics(Replica(profile("mi355x-glm52-tp4"))).registry
    return {fam.name + sfx for fam in registry.collect() for sfx in suffixes[fam.type]}


def test_dashboard_queries_only_metrics_the_gateway_and_the_engines_export():
    dash = json.loads((DEPLOY / "k8s" / "base" / "grafana-dashboard.json").read_text())
    panels = [p for p in dash["panels"] if p["type"] != "row"]
    exported = exported_metric_names()
    exprs = [t["expr"] for p in panels for t in p["targets"]]
    used = {m for e in exprs for m in re.findall(r"\b(gateway_[a-z_]+)", e)}
    assert used and used <= exported, used - exported
    engine = {m for e in exprs for m in re.findall(r"\b(sglang:[a-z_]+)", e)}
    assert engine and engine <= engine_metric_names(), engine - engine_metric_names()
    titles = " ".join(p["title"] for p in panels).lower()
    for topic in ("ttft", "hit rate", "sla", "cost", "branch", "by tenant", "by replica", "ejected", "breaker",
                  "engine", "inter-token"):
        assert topic in titles, topic
    # the per-replica truth of a gray failure is on it: observed and predicted TTFT, the correction, ejections
    for metric in ("gateway_replica_ttft_seconds_bucket", "gateway_replica_ttft_correction", "gateway_replica_ejected",
                   "gateway_replica_ejections_total", "gateway_replica_itl_seconds_bucket"):
        assert metric in used, metric
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert {"datasource", "tenant", "pool", "instance"} <= set(variables)
    for name in ("tenant", "pool", "instance"):  # every gateway panel filters by them where the metric has the label
        assert "label_values(gateway_" in variables[name]["query"]["query"]
    for p in panels:
        for t in p["targets"]:
            if "gateway_" in t["expr"]:
                assert "$instance" in t["expr"], p["title"]
            if "tenant" in p["title"].lower() and "gateway_" in t["expr"]:
                assert "$tenant" in t["expr"], p["title"]
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))


def test_compose_prometheus_scrapes_the_gateways_and_engines_and_grafana_shows_the_dashboard():
    """The local stack's Prometheus scrapes every gateway and engine the compose file runs (hosts are its services,
    ports the ones they listen on), and Grafana is provisioned with that Prometheus and the shipped dashboard."""
    compose = yaml.safe_load((DEPLOY / "compose.yaml").read_text())
    services = compose["services"]
    prom_svc, grafana = services["prometheus"], services["grafana"]
    prom = yaml.safe_load((DEPLOY / "compose" / "prometheus.yaml").read_text())
    mounted = {v.split(":")[1]: v.split(":")[0] for v in prom_svc["volumes"]}
    config_path = next(a.split("=", 1)[1] for a in prom_svc["command"] if a.startswith("--config.file="))
    assert (DEPLOY / mounted[config_path]).resolve() == (DEPLOY / "compose" / "prometheus.yaml").resolve()
    jobs = {j["job_name"]: [t for sc in j["static_configs"] for t in sc["targets"]] for j in prom["scrape_configs"]}
    gateways = {name for name, svc in services.items() if svc.get("command", [None])[0] == "serve"}
    assert {t.split(":")[0] for t in jobs["gateway"]} == gateways
    admin = load_config(DEPLOY / "compose" / "gateway.yaml").admin  # /metrics is on the admin listener only
    assert not admin.metrics_token_hashes  # (a scrape token would need bearer auth in the scrape config)
    for t in jobs["gateway"]:
        cmd = services[t.split(":")[0]]["command"]
        assert int(t.split(":")[1]) == admin.listen_port(int(cmd[cmd.index("--port") + 1]))
    engines: set[str] = set()
    for name, svc in services.items():
        cmd = svc.get("command") or []
        if cmd and cmd[0] == "sim":  # a simulator process serves --replicas servers on consecutive ports
            first, n = int(cmd[cmd.index("--port") + 1]), int(cmd[cmd.index("--replicas") + 1])
            engines |= {f"{name}:{first + i}" for i in range(n)}
    assert set(jobs["sglang"]) == engines
    ds = yaml.safe_load((DEPLOY / "compose" / "grafana" / "datasources.yaml").read_text())["datasources"][0]
    assert ds["type"] == "prometheus" and ds["url"] == "http://prometheus:9090" and ds["isDefault"]
    assert "127.0.0.1:9090:9090" in prom_svc["ports"] and "127.0.0.1:3000:3000" in grafana["ports"]
    gmounts = {v.split(":")[1]: v.split(":")[0] for v in grafana["volumes"]}
    provider = yaml.safe_load((DEPLOY / "compose" / "grafana" / "dashboards.yaml").read_text())["providers"][0]
    dash_dir = provider["options"]["path"]
    shipped = [(DEPLOY / src).resolve() for dst, src in gmounts.items() if dst.startswith(dash_dir + "/")]
    assert shipped == [(DEPLOY / "k8s" / "base" / "grafana-dashboard.json").resolve()]
    assert any(dst.startswith("/etc/grafana/provisioning/datasources/") for dst in gmounts)
    assert any(dst.startswith("/etc/grafana/provisioning/dashboards/") for dst in gmounts)


def test_sglang_recipes_carry_the_flags_the_fitted_profile_assumes():
    common = (DEPLOY / "sglang" / "serve-tp4-groups.sh").read_text()
    mi = (DEPLOY / "sglang" / "mi355x-glm52-tp4.sh").read_text() + common
    for flag in ("--tp 4", "--kv-cache-dtype fp8_e4m3", "--enable-aiter-allreduce-fusion", "--speculative-num-steps 5",
                 "--speculative-eagle-topk 1", "--speculative-num-draft-tokens 6", "--enable-cache-report",
                 "--enable-metrics", "--chunked-prefill-size 16384", "--max-running-requests 48", "MXFP4"):
        assert flag in mi, flag
    commands = "\n".join(line for line in mi.splitlines() if not line.lstrip().startswith("#"))
    assert "for g in 0 1" in commands and "--dp" not in commands  # one server per TP4 group
    b = (DEPLOY / "sglang" / "b200-glm52.sh").read_text()
    assert "serve-tp4-groups.sh" in b and "CUDA_VISIBLE_DEVICES" in b and "HIP_VISIBLE_DEVICES" in mi
    pools = yaml.safe_load((DEPLOY / "sglang" / "pools.example.yaml").read_text())
    cfg = parse_config({**pools, "tenants": [{"name": "t", "api_key_hashes": ["0" * 64], "models": ["glm-5.2"]}]})
    assert [p.kind for p in cfg.pools] == ["sglang", "sglang", "openai"]


@pytest.mark.parametrize("script", ["serve-tp4-groups.sh", "serve-dp.sh"])
def test_sglang_recipes_schedule_by_priority_or_shortest_prefill(tmp_path: Path, script: str) -> None:
    """SCHEDULE picks the ranks' queue order. The recipes run with a `python3` on PATH that prints its arguments, so
    this checks the command line SGLang would get: priority scheduling by default, shortest-prefill-first without it
    (SGLang refuses the two together), anything else refused before a server starts."""
    shim = tmp_path / "bin" / "python3"
    shim.parent.mkdir()
    shim.write_text('#!/bin/sh\necho "$@"\n')
    shim.chmod(0o755)
    env = {"PATH": f"{shim.parent}:/usr/bin:/bin", "MODEL": "m", "PORT": "1", "BASE_PORT": "1",
           "DEVICES_VAR": "HIP_VISIBLE_DEVICES"}

    def run(schedule: str | None) -> subprocess.CompletedProcess[str]:
        e = env if schedule is None else {**env, "SCHEDULE": schedule}
        return subprocess.run(["bash", str(DEPLOY / "sglang" / script)], cwd=tmp_path, env=e, capture_output=True,
                              text=True, timeout=30)

    def argv() -> str:
        logs = sorted(tmp_path.glob("sglang-*.log"))
        return " ".join(p.read_text() for p in logs) if logs else ""

    r = run(None)
    out = r.stdout + argv()
    assert r.returncode == 0 and "--enable-priority-scheduling --default-priority-value 0" in out
    assert "--schedule-policy" not in out
    for p in tmp_path.glob("sglang-*.log"):
        p.unlink()
    r = run("shortest-prefill-first")
    out = r.stdout + argv()
    assert r.returncode == 0 and "--schedule-policy shortest-prefill-first" in out
    assert "--enable-priority-scheduling" not in out
    bad = run("lpm")
    assert bad.returncode == 2 and "SCHEDULE must be" in bad.stderr
