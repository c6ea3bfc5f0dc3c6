#!/usr/bin/env python3
"""Offline validation of deploy/: run by deploy/validate.sh (which installs the
tools), see docs/deploy.md. Each check prints one line; any failure makes the
exit status 1.

  validate.py static            kustomize, schemas, promtool, dashboard, metric names
  validate.py metrics BIN_DIR   promtool check metrics on each binary's real /metrics
"""

import copy
import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import yaml

DEPLOY = Path(__file__).resolve().parent
ROOT = DEPLOY.parent
K8S = DEPLOY / "k8s"
TOKEN_FILE = K8S / "base" / "internal-token"
# The Kubernetes version the core objects are validated against.
K8S_VERSION = os.environ.get("PDSERVE_K8S_VERSION", "1.33.0")
METRICS_RS = Path(os.environ.get("PDSERVE_METRICS_RS", ROOT / "shared/runtime/src/metrics.rs"))
# Prometheus' own series that queries may use besides pdserve's.
PROMETHEUS_SERIES = {"up"}
# What the local autoscaler uses (issue 6); the ScaledObjects must agree.
POLICY = {
    "prefill": {"min": 0, "max": 8},
    "decode": {"min": 1, "max": 8},
}
STABILIZATION = {"scaleUp": 0, "scaleDown": 60}
PRESTOP_SLEEP_SECONDS = 5

failures = []


def check(name, ok, detail=""):
    print(f"{'ok  ' if ok else 'FAIL'} {name}{': ' + detail if detail and not ok else ''}")
    if not ok:
        failures.append(name)
    return ok


def run(cmd, **kw):
    return subprocess.run(cmd, capture_output=True, text=True, **kw)


# ---- metric names ------------------------------------------------------------

def defined_metrics():
    text = METRICS_RS.read_text()
    return set(re.findall(r'pub const [A-Z0-9_]+: &str = "(pdserve_[a-z0-9_]+)";', text))


def referenced_metrics(expr):
    """Metric names in a PromQL expression (pdserve_* and Prometheus' own)."""
    names = set(re.findall(r"\bpdserve_[a-z0-9_]+", expr))
    names |= {n for n in PROMETHEUS_SERIES if re.search(rf"(?<![\w.]){n}\s*\{{", expr)}
    return names


def unknown_metrics(exprs, defined):
    bad = set()
    for expr in exprs:
        for name in referenced_metrics(expr):
            if name in PROMETHEUS_SERIES:
                continue
            base = re.sub(r"_(bucket|sum|count)$", "", name)
            if name not in defined and base not in defined:
                bad.add(name)
    return sorted(bad)


# ---- Kubernetes ----------------------------------------------------------------

def render_all(kubectl, out_dir):
    """Renders a copy of deploy/k8s in which base/internal-token (gitignored,
    written by make-token.sh) holds a throwaway token: a real one is never
    read, and a checkout without one renders too."""
    k8s = out_dir / "k8s"
    shutil.copytree(K8S, k8s, ignore=shutil.ignore_patterns(TOKEN_FILE.name))
    r = run([kubectl, "kustomize", str(k8s / "base")])
    check("kustomize refuses the base without base/internal-token", r.returncode != 0 and "internal-token" in r.stderr)
    (k8s / "base" / TOKEN_FILE.name).write_text(secrets.token_hex(32))
    r = run(["git", "-C", str(ROOT), "check-ignore", "-q", str(TOKEN_FILE.relative_to(ROOT))])
    if r.returncode in (0, 1):  # 128: git is missing or this is not a work tree
        check(f"git ignores {TOKEN_FILE.relative_to(ROOT)}", r.returncode == 0)
    rendered = {}
    targets = [k8s / "base"] + sorted((k8s / "overlays").iterdir())
    for target in targets:
        name = target.relative_to(k8s).as_posix()
        r = run([kubectl, "kustomize", str(target)])
        if check(f"kustomize renders {name}", r.returncode == 0, r.stderr.strip()):
            docs = [d for d in yaml.safe_load_all(r.stdout) if d]
            (out_dir / (name.replace("/", "_") + ".yaml")).write_text(r.stdout)
            rendered[name] = docs
    return rendered


def strict(schema):
    """Reject unknown fields like the API server's strict field validation:
    additionalProperties: false wherever an object lists its properties."""
    if isinstance(schema, dict):
        if "properties" in schema and "additionalProperties" not in schema:
            schema["additionalProperties"] = False
        for v in schema.values():
            strict(v)
    elif isinstance(schema, list):
        for v in schema:
            strict(v)
    return schema


def crd_schemas():
    """JSON schemas of the custom resources, generated from the typed models
    that cloudcoil builds from the KEDA and prometheus-operator CRDs."""
    from cloudcoil.models.keda import v1alpha1 as keda
    from cloudcoil.models.prometheus_operator import v1 as promop

    return {
        ("keda.sh/v1alpha1", "ScaledObject"): strict(keda.ScaledObject.model_json_schema(by_alias=True)),
        ("monitoring.coreos.com/v1", "PodMonitor"): strict(promop.PodMonitor.model_json_schema(by_alias=True)),
        ("monitoring.coreos.com/v1", "ServiceMonitor"): strict(promop.ServiceMonitor.model_json_schema(by_alias=True)),
    }


def validate_objects(rendered):
    import jsonschema
    import kubernetes_validate

    schemas = crd_schemas()
    for overlay, docs in rendered.items():
        for doc in docs:
            key = (doc.get("apiVersion"), doc.get("kind"))
            name = f"{overlay}: {doc['kind']}/{doc['metadata']['name']}"
            if key in schemas:
                v = jsonschema.Draft202012Validator(schemas[key])
                errs = sorted(v.iter_errors(doc), key=lambda e: list(e.absolute_path))
                detail = "; ".join(f"{'/'.join(map(str, e.absolute_path))}: {e.message[:200]}" for e in errs[:3])
                check(f"{name} matches its CRD schema", not errs, detail)
                continue
            try:
                kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
                check(f"{name} is valid Kubernetes {K8S_VERSION}", True)
            except kubernetes_validate.ValidationError as e:
                check(f"{name} is valid Kubernetes {K8S_VERSION}", False, f"{'/'.join(map(str, e.path))}: {e.message}")
            except Exception as e:  # an unknown kind, a missing schema
                check(f"{name} is valid Kubernetes {K8S_VERSION}", False, repr(e))
        check_consistency(overlay, docs)


def env_of(container, configmaps):
    env = {}
    for src in container.get("envFrom", []):
        ref = src.get("configMapRef", {}).get("name")
        env.update(configmaps.get(ref, {}))
    for e in container.get("env", []):
        if "value" in e:
            env[e["name"]] = e["value"]
    return env


def check_consistency(overlay, docs):
    """What no schema knows: the pieces must agree with each other."""
    by_kind = {}
    for d in docs:
        by_kind.setdefault(d["kind"], {})[d["metadata"]["name"]] = d
    configmaps = {n: d.get("data", {}) for n, d in by_kind.get("ConfigMap", {}).items()}
    services = by_kind.get("Service", {})
    deployments = by_kind.get("Deployment", {})
    for name, dep in deployments.items():
        pod = dep["spec"]["template"]["spec"]
        c = pod["containers"][0]
        env = env_of(c, configmaps)
        drain = int(env.get("PDSERVE_DRAIN_SECONDS", 30))
        grace = pod.get("terminationGracePeriodSeconds", 30)
        check(f"{overlay}: {name} grace period {grace}s covers preStop + drain ({PRESTOP_SLEEP_SECONDS}+{drain}s)",
              grace >= drain + PRESTOP_SLEEP_SECONDS)
        probes = {p: c.get(p, {}).get("httpGet", {}).get("path") for p in ("readinessProbe", "livenessProbe")}
        check(f"{overlay}: {name} probes /ready and /health",
              probes == {"readinessProbe": "/ready", "livenessProbe": "/health"}, str(probes))
        check(f"{overlay}: {name} listens on all interfaces", env.get("PDSERVE_HOST") == "0.0.0.0")
        for dns_var in ("PDSERVE_PREFILL_DNS", "PDSERVE_DECODE_DNS"):
            if dns_var in env:
                svc_name, port = env[dns_var].split(".")[0], int(env[dns_var].rsplit(":", 1)[1])
                svc = services.get(svc_name, {}).get("spec", {})
                check(f"{overlay}: {name} {dns_var} names a headless service and its port",
                      svc.get("clusterIP") == "None" and any(p["port"] == port for p in svc.get("ports", [])),
                      env[dns_var])
        check_token_mount(overlay, name, pod, by_kind.get("Secret", {}))
    check_network_policies(overlay, deployments, by_kind.get("NetworkPolicy", {}))
    router_env = {}
    if "router" in deployments:
        router_env = env_of(deployments["router"]["spec"]["template"]["spec"]["containers"][0], configmaps)
    for name, so in by_kind.get("ScaledObject", {}).items():
        spec = so["spec"]
        check_router_policy(overlay, name, spec, router_env)
        target = spec["scaleTargetRef"]["name"]
        check(f"{overlay}: ScaledObject/{name} targets an existing Deployment", target in deployments, target)
        if overlay == "base" and name in POLICY:
            check(f"{overlay}: ScaledObject/{name} replicas {POLICY[name]['min']}..{POLICY[name]['max']}",
                  (spec.get("minReplicaCount"), spec.get("maxReplicaCount")) == (POLICY[name]["min"], POLICY[name]["max"]))
        behavior = spec.get("advanced", {}).get("horizontalPodAutoscalerConfig", {}).get("behavior", {})
        windows = {k: behavior.get(k, {}).get("stabilizationWindowSeconds") for k in STABILIZATION}
        check(f"{overlay}: ScaledObject/{name} stabilization windows {STABILIZATION}", windows == STABILIZATION, str(windows))
        for t in spec["triggers"]:
            q = t["metadata"].get("query", "")
            one = re.fullmatch(r"\s*(sum|max|min|avg|count)\s*\((?:(?!\bby\b|\bwithout\b).)*\)\s+or\s+vector\(0\)\s*", q, re.S)
            check(f"{overlay}: ScaledObject/{name} trigger {t.get('name')} returns one series", bool(one), q)


def check_token_mount(overlay, name, pod, secrets_):
    """The container reads the internal token from a file mounted from a
    Secret of the rendered output, which the pod cannot start without."""
    c = pod["containers"][0]
    env = {e["name"]: e for e in c.get("env", [])}
    path = env.get("PDSERVE_INTERNAL_TOKEN_FILE", {}).get("value", "")
    mount_dir, _, file = path.rpartition("/")
    mount = next((m for m in c.get("volumeMounts", []) if m["mountPath"].rstrip("/") == mount_dir), {})
    vol = next((v for v in pod.get("volumes", []) if v["name"] == mount.get("name")), {}).get("secret", {})
    key = {i["path"]: i["key"] for i in vol.get("items", [])}.get(file, file)
    data = secrets_.get(vol.get("secretName"), {}).get("data", {})
    ok = bool(path) and "PDSERVE_INTERNAL_TOKEN" not in env and vol.get("optional") is not True and key in data
    check(f"{overlay}: {name} reads the internal token from a mounted, required Secret", ok,
          f"PDSERVE_INTERNAL_TOKEN_FILE={path!r}, volume {mount.get('name')!r}, Secret {vol.get('secretName')!r} "
          f"(optional: {vol.get('optional')}), key {key!r}, PDSERVE_INTERNAL_TOKEN set: {'PDSERVE_INTERNAL_TOKEN' in env}")


# Who may connect to each component's port under the NetworkPolicies: the
# components, Prometheus in namespace monitoring, a pod of another namespace,
# and an unrelated pod of pdserve's own namespace.
SOURCES = ("router", "prefill", "decode", "prometheus", "other-namespace", "other-pod")
REACHABLE = {
    "router": set(SOURCES),
    "prefill": {"router", "prometheus"},
    "decode": {"router", "prefill", "prometheus"},
}


def selects(selector, labels):
    """Whether a label selector (matchLabels, matchExpressions) selects `labels`."""
    if any(labels.get(k) != v for k, v in selector.get("matchLabels", {}).items()):
        return False
    for e in selector.get("matchExpressions", []):
        has, values = e["key"] in labels, e.get("values", [])
        ok = {"In": has and labels.get(e["key"]) in values, "NotIn": labels.get(e["key"]) not in values,
              "Exists": has, "DoesNotExist": not has}[e["operator"]]
        if not ok:
            return False
    return True


def admits(policies, target, source, port):
    """Whether NetworkPolicies let `source` open a TCP connection to `target`
    on `port`. Each is (namespace, pod labels, {port name: number})."""
    (ns, labels, named), (src_ns, src_labels, _) = target, source
    specs = [p["spec"] for p in policies if p["metadata"].get("namespace") == ns
             and selects(p["spec"].get("podSelector", {}), labels)
             and "Ingress" in p["spec"].get("policyTypes", ["Ingress"])]
    if not specs:
        return True

    def port_ok(p):
        first = named.get(p["port"]) if isinstance(p.get("port"), str) else p.get("port", port)
        return p.get("protocol", "TCP") == "TCP" and first is not None and first <= port <= p.get("endPort", first)

    def peer_ok(peer):
        if "ipBlock" in peer:  # the sources here are pods, not addresses
            return False
        in_ns = (selects(peer["namespaceSelector"], {"kubernetes.io/metadata.name": src_ns})
                 if "namespaceSelector" in peer else src_ns == ns)
        return in_ns and selects(peer.get("podSelector", {}), src_labels)

    return any((not rule.get("ports") or any(map(port_ok, rule["ports"])))
               and (not rule.get("from") or any(map(peer_ok, rule["from"])))
               for spec in specs for rule in spec.get("ingress", []))


def check_network_policies(overlay, deployments, policies):
    """Evaluates the NetworkPolicies for every source against each component's
    `http` port (REACHABLE) and against another port (nobody)."""
    pods = {}
    for name, dep in deployments.items():
        tpl = dep["spec"]["template"]
        named = {p["name"]: p["containerPort"] for c in tpl["spec"]["containers"] for p in c.get("ports", []) if "name" in p}
        pods[name] = (dep["metadata"].get("namespace"), tpl["metadata"].get("labels", {}), named)
    ns = next(iter(pods.values()))[0] if pods else None
    sources = {n: pods[n] for n in SOURCES if n in pods}
    sources |= {"prometheus": ("monitoring", {"app.kubernetes.io/name": "prometheus"}, {}),
                "other-namespace": ("default", {"app": "other"}, {}),
                "other-pod": (ns, {"app": "other"}, {})}
    for target, want in REACHABLE.items():
        if target not in pods or "http" not in pods[target][2]:
            check(f"{overlay}: Deployment/{target} has a port named http", False)
            continue
        port = pods[target][2]["http"]
        got = {s for s, src in sources.items() if admits(policies.values(), pods[target], src, port)}
        check(f"{overlay}: NetworkPolicies admit to {target}:{port} only {', '.join(sorted(want))}",
              got == want, f"admitted: {', '.join(sorted(got))}")
        other = {s for s, src in sources.items() if admits(policies.values(), pods[target], src, port + 1)}
        check(f"{overlay}: NetworkPolicies admit nobody to {target}'s other ports", not other,
              f"admitted on {port + 1}: {', '.join(sorted(other))}")


def check_router_policy(overlay, pool, spec, env):
    """The router's export-only autoscaler must decide what KEDA does, or the
    dashboard's desired replicas would mislead; in planned mode KEDA sums the
    routers' demand instead, each router seeing its own share of the load."""
    if env.get("PDSERVE_AUTOSCALER_EXECUTOR") != "none":
        check(f"{overlay}: router runs the export-only autoscaler", False, str(env.get("PDSERVE_AUTOSCALER_EXECUTOR")))
        return
    p = pool.upper()
    want = {f"PDSERVE_{p}_MIN_REPLICAS": spec.get("minReplicaCount"),
            f"PDSERVE_{p}_MAX_REPLICAS": spec.get("maxReplicaCount")}
    first = spec["triggers"][0]["metadata"]["threshold"]
    got = {k: env.get(k) for k in want}
    bounds = all(str(v) == str(got[k]) for k, v in want.items())
    if env.get("PDSERVE_AUTOSCALER_MODE") == "planned":
        # One trigger: this pool's demand summed over the routers, a replica per unit.
        queries = [t["metadata"].get("query", "") for t in spec["triggers"]]
        follows = (len(queries) == 1 and "sum(pdserve_autoscaler_demand_replicas{" in queries[0]
                   and f'pool="{pool}"' in queries[0] and float(first) == 1.0)
        model = env.get("PDSERVE_AUTOSCALER_MODEL", "")
        check(f"{overlay}: planned {pool} follows the routers' summed demand", bounds and follows and bool(model),
              f"router {got} model={model!r}; ScaledObject {want} queries={queries} threshold={first}")
        return
    target_var = "PDSERVE_PREFILL_TARGET_BACKLOG_SECONDS" if pool == "prefill" else "PDSERVE_DECODE_TARGET"
    ok = bounds and float(env.get(target_var, "nan")) == float(first)
    check(f"{overlay}: router policy for {pool} matches its ScaledObject", ok,
          f"router {got} {target_var}={env.get(target_var)}; ScaledObject {want} threshold={first}")


def quantity(q):
    """A Kubernetes quantity or a KEDA threshold as a number ("700m" -> 0.7)."""
    q = str(q)
    return float(q[:-1]) / 1000 if q.endswith("m") else float(q)


def hpa_spec_of(so):
    """The autoscaling/v2 spec KEDA makes of a ScaledObject of Prometheus
    triggers: the same bounds and behaviour, one External metric per trigger
    (KEDA's metrics adapter serves the query's value under the trigger's name)."""
    spec = so["spec"]
    metrics = []
    for t in spec["triggers"]:
        kind = t.get("metricType", "AverageValue")
        target = {"type": kind, {"AverageValue": "averageValue", "Value": "value"}[kind]: quantity(t["metadata"]["threshold"])}
        metrics.append({"type": "External", "external": {"metric": {"name": t["name"]}, "target": target}})
    return {
        "scaleTargetRef": spec["scaleTargetRef"],
        # KEDA keeps the HPA at one replica at least and does 0 <-> 1 itself.
        "minReplicas": max(1, spec.get("minReplicaCount", 0)),
        "maxReplicas": spec["maxReplicaCount"],
        "metrics": metrics,
        "behavior": spec.get("advanced", {}).get("horizontalPodAutoscalerConfig", {}).get("behavior"),
    }


def normalised_hpa_spec(hpa):
    spec = copy.deepcopy(hpa["spec"])
    for m in spec.get("metrics", []):
        target = m.get("external", {}).get("target", {})
        for key in ("averageValue", "value"):
            if key in target:
                target[key] = quantity(target[key])
    return spec


def check_local_e2e(kubectl, work, base_docs):
    """deploy/k8s/local-e2e, the overlay deploy/k8s/e2e.sh applies to a live
    Kubernetes 1.20: it renders, every object uses an API 1.20 serves, and
    its HPA (in place of KEDA) is exactly what KEDA makes of the base's
    ScaledObject for decode."""
    r = run([kubectl, "kustomize", str(work / "k8s" / "local-e2e")])
    if not check("kustomize renders local-e2e", r.returncode == 0, r.stderr.strip()):
        return
    docs = [d for d in yaml.safe_load_all(r.stdout) if d]
    # The schema package starts at 1.25, and autoscaling/v2beta2 is gone
    # since 1.26: the live run checks the objects; this checks that each
    # uses a group version Kubernetes 1.20 serves.
    served = {"v1", "apps/v1", "autoscaling/v1", "autoscaling/v2beta2", "networking.k8s.io/v1"}
    for doc in docs:
        name = f"local-e2e: {doc['kind']}/{doc['metadata']['name']}"
        check(f"{name} uses an API version 1.20 serves", doc["apiVersion"] in served, doc["apiVersion"])
    hpas = {d["metadata"]["name"]: d for d in docs if d["kind"] == "HorizontalPodAutoscaler"}
    scaled = {d["metadata"]["name"]: d for d in base_docs if d["kind"] == "ScaledObject"}
    if check("local-e2e: an HPA for decode and a base ScaledObject for it", "decode" in hpas and "decode" in scaled):
        got, want = normalised_hpa_spec(hpas["decode"]), hpa_spec_of(scaled["decode"])
        check("local-e2e: HPA/decode is what KEDA makes of ScaledObject/decode", got == want,
              f"HPA {json.dumps(got, sort_keys=True)} != KEDA {json.dumps(want, sort_keys=True)}")


# ---- Prometheus ---------------------------------------------------------------

def promtool_checks(work):
    prom = DEPLOY / "prometheus"
    r = run(["promtool", "check", "rules", str(prom / "alerts.yml")])
    check("promtool check rules alerts.yml", r.returncode == 0, (r.stdout + r.stderr).strip())
    r = run(["promtool", "test", "rules", str(prom / "alerts_test.yml")])
    check("promtool test rules alerts_test.yml", r.returncode == 0, (r.stdout + r.stderr).strip()[-2000:])
    # Debian's promtool is built without Kubernetes service discovery, so the
    # kubernetes_sd_configs block is checked here for its fields and then
    # swapped for an equivalent file_sd_configs, keeping every relabelling
    # rule, for promtool to check the rest of the file.
    cfg = yaml.safe_load((prom / "prometheus.yml").read_text())
    allowed = {"role", "namespaces", "selectors", "api_server", "kubeconfig_file", "attach_metadata"}
    for sc in cfg.get("scrape_configs", []):
        for sd in sc.get("kubernetes_sd_configs", []):
            ok = set(sd) <= allowed and sd.get("role") in {"pod", "service", "endpoints", "endpointslice", "node", "ingress"}
            check(f"prometheus.yml job {sc['job_name']}: kubernetes_sd_configs fields", ok, str(sd))
        if sc.pop("kubernetes_sd_configs", None) is not None:
            sc["file_sd_configs"] = [{"files": ["targets.json"]}]
    (work / "prometheus.yml").write_text(yaml.safe_dump(cfg))
    shutil.copy(prom / "alerts.yml", work / "alerts.yml")
    r = run(["promtool", "check", "config", str(work / "prometheus.yml")])
    check("promtool check config prometheus.yml", r.returncode == 0, (r.stdout + r.stderr).strip())


def promql_parses(exprs, work):
    """promtool parses every query of the dashboard and the ScaledObjects, as
    recording rules (Grafana's $__rate_interval and $namespace substituted)."""
    rules = []
    for i, e in enumerate(exprs):
        e = e.replace("$__rate_interval", "1m").replace("$namespace", ".*")
        rules.append({"record": f"pdserve:check_{i}", "expr": e})
    path = work / "queries.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "queries", "rules": rules}]}))
    r = run(["promtool", "check", "rules", str(path)])
    check(f"promtool parses the {len(exprs)} dashboard and ScaledObject queries", r.returncode == 0,
          (r.stdout + r.stderr).strip()[-2000:])


def dashboard_exprs():
    path = DEPLOY / "grafana" / "pdserve.json"
    try:
        dash = json.loads(path.read_text())
    except ValueError as e:
        check("grafana/pdserve.json parses", False, str(e))
        return []
    check("grafana/pdserve.json parses", True)
    exprs = []

    def walk(panels):
        for p in panels:
            exprs.extend(t["expr"] for t in p.get("targets", []) if "expr" in t)
            walk(p.get("panels", []))
    walk(dash.get("panels", []))
    check("grafana/pdserve.json has queries", len(exprs) > 10, str(len(exprs)))
    return exprs


def alert_exprs():
    doc = yaml.safe_load((DEPLOY / "prometheus" / "alerts.yml").read_text())
    return [r["expr"] for g in doc["groups"] for r in g["rules"]]


def shell_scripts():
    """The Slurm and Docker scripts, up.sh, make-token.sh and the validation script parse
    (`bash -n`), and pass shellcheck when it is installed."""
    for script in (DEPLOY / "slurm" / "pdserve.sbatch", DEPLOY / "slurm" / "e2e.sh",
                   DEPLOY / "docker" / "e2e.sh", DEPLOY / "docker" / "lib.sh",
                   K8S / "e2e.sh", K8S / "build-1.20.sh",
                   DEPLOY / "local" / "up.sh",
                   K8S / "make-token.sh", DEPLOY / "validate.sh"):
        r = run(["bash", "-n", str(script)])
        check(f"bash -n {script.relative_to(ROOT)}", r.returncode == 0, r.stderr.strip())
        if shutil.which("shellcheck"):
            r = run(["shellcheck", str(script)])
            check(f"shellcheck {script.relative_to(ROOT)}", r.returncode == 0, r.stdout.strip()[-1500:])


def static(kubectl):
    defined = defined_metrics()
    check(f"metric names read from {METRICS_RS.relative_to(ROOT) if METRICS_RS.is_relative_to(ROOT) else METRICS_RS}",
          len(defined) > 20, str(len(defined)))
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        rendered = render_all(kubectl, work)
        validate_objects(rendered)
        check_local_e2e(kubectl, work, rendered.get("base", []))
        promtool_checks(work)
        dash = dashboard_exprs()
        scaled = [t["metadata"]["query"] for docs in rendered.values() for d in docs
                  if d["kind"] == "ScaledObject" for t in d["spec"]["triggers"]]
        promql_parses(dash + scaled, work)
        for what, exprs in (("dashboard", dash), ("alert rules", alert_exprs()), ("ScaledObjects", scaled)):
            bad = unknown_metrics(exprs, defined)
            check(f"every metric in the {what} is defined in metrics.rs", not bad, ", ".join(bad))
    shell_scripts()


# ---- real /metrics -------------------------------------------------------------

def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get(url, timeout=2.0):
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.status, r.read().decode()


def wait_ready(url, proc, seconds=120):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return False
        try:
            if get(url + "/ready")[0] == 200:
                return True
        except OSError:
            pass
        time.sleep(0.3)
    return False


def metrics(bin_dir, model):
    """Starts decode, prefill and router on loopback (one model thread each)
    with an internal token, sends one disaggregated request so that histograms
    and labelled series exist, and runs `promtool check metrics` on each
    /metrics (open, like /ready; an internal endpoint without the token is not)."""
    defined = defined_metrics()
    ports = {c: free_port() for c in ("decode", "prefill", "router")}
    urls = {c: f"http://127.0.0.1:{p}" for c, p in ports.items()}
    env = {**os.environ, "PDSERVE_LOG": "warn", "PDSERVE_INTERNAL_TOKEN": secrets.token_hex(32)}
    env.pop("PDSERVE_INTERNAL_TOKEN_FILE", None)
    envs = {"decode": env, "router": env, "prefill": {**env, "PDSERVE_DECODE_URLS": urls["decode"]}}
    common = ["--host", "127.0.0.1", "--model", str(model), "--drain-seconds", "2"]
    cmds = {
        "decode": [f"{bin_dir}/pdserve-decode", "--port", str(ports["decode"]), "--threads", "1",
                   "--kv-cache-tokens", "2048", *common],
        "prefill": [f"{bin_dir}/pdserve-prefill", "--port", str(ports["prefill"]), "--threads", "1", *common],
        "router": [f"{bin_dir}/pdserve-router", "--port", str(ports["router"]), "--mode", "disaggregated",
                   "--decode-url", urls["decode"], "--prefill-url", urls["prefill"], *common],
    }
    procs = {}
    logs = tempfile.TemporaryDirectory()
    try:
        for c in ("decode", "prefill", "router"):
            log = open(Path(logs.name) / f"{c}.log", "w")
            procs[c] = subprocess.Popen(cmds[c], stdout=log, stderr=subprocess.STDOUT, env=envs[c])
            if c != "router" and not check(f"{c} starts", wait_ready(urls[c], procs[c]),
                                           (Path(logs.name) / f"{c}.log").read_text()[-1500:]):
                return
        if not check("router starts", wait_ready(urls["router"], procs["router"]),
                     (Path(logs.name) / "router.log").read_text()[-1500:]):
            return
        body = json.dumps({"model": Path(model).stem, "max_tokens": 4,
                           "prompt": "The capital of France is Paris. The capital of Italy is"}).encode()
        req = urllib.request.Request(urls["router"] + "/v1/completions", body, {"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=60) as r:
                check("a disaggregated completion succeeds", r.status == 200)
        except OSError as e:
            check("a disaggregated completion succeeds", False, str(e))
        for c in ("prefill", "decode"):
            try:
                status = get(urls[c] + "/load")[0]
            except urllib.error.HTTPError as e:
                status = e.code
            check(f"{c} refuses /load without the internal token (401)", status == 401, str(status))
        for c in ("router", "prefill", "decode"):
            _, text = get(urls[c] + "/metrics")
            r = run(["promtool", "check", "metrics"], input=text)
            check(f"promtool check metrics on {c} /metrics", r.returncode == 0, (r.stdout + r.stderr).strip())
            exported = set(re.findall(r"^# TYPE (\S+)", text, re.M))
            check(f"{c} exports only names defined in metrics.rs", exported <= defined,
                  ", ".join(sorted(exported - defined)))
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in procs.values():
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                p.kill()
        logs.cleanup()


def main(argv):
    if len(argv) >= 2 and argv[1] == "static":
        static(os.environ.get("KUBECTL", "kubectl"))
    elif len(argv) == 4 and argv[1] == "metrics":
        metrics(argv[2], argv[3])
    else:
        sys.exit(__doc__)
    print(f"{'FAILED' if failures else 'passed'}: {len(failures)} failure(s)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
