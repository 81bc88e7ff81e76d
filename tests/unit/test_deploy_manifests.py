"""deploy/: every manifest parses, carries what production needs, and names real metrics.

Metric names are checked against server/metric_names.py (the one list the server's
registry is built from), so a renamed metric breaks this test instead of a dashboard.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from server.metric_names import (
    LATENCY_BUCKETS,
    METRICS,
    METRICS_BY_NAME,
    MODEL_LABEL,
    SERIES_NAMES,
    TOKEN_BUCKETS,
    VLLM_COUNTERPARTS,
    markdown_table,
    vllm_porting_table,
)

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
METRIC_RE = re.compile(r"tessera:[A-Za-z0-9_:]+")


def _yaml_files() -> list[Path]:
    return sorted(p for p in DEPLOY.rglob("*") if p.suffix in (".yaml", ".yml"))


def _docs(path: Path) -> list[Any]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]


def _k8s(kind: str) -> list[dict]:
    found = []
    for path in (DEPLOY / "k8s").glob("*.yaml"):
        found += [doc for doc in _docs(path) if isinstance(doc, dict) and doc.get("kind") == kind]
    return found


def _one(kind: str) -> dict:
    [doc] = _k8s(kind)
    return doc


def _container() -> dict:
    [container] = _one("Deployment")["spec"]["template"]["spec"]["containers"]
    return container


def _dashboard() -> dict:
    return json.loads((DEPLOY / "grafana" / "tessera.json").read_text())


def _dashboard_exprs() -> list[str]:
    exprs = []
    for panel in _dashboard()["panels"]:
        exprs += [target["expr"] for target in panel.get("targets", [])]
    for variable in _dashboard()["templating"]["list"]:
        if variable.get("type") == "query":
            exprs.append(variable["definition"])
    return exprs


def _adapter_rules() -> list[dict]:
    [values] = _docs(DEPLOY / "k8s" / "prometheus-adapter-values.yaml")
    return values["rules"]["custom"]


# ---- everything parses -------------------------------------------------------------------


def test_every_yaml_and_json_under_deploy_parses():
    files = _yaml_files()
    assert len(files) >= 8
    for path in files:
        assert _docs(path), f"{path.relative_to(ROOT)} is empty"
    for path in DEPLOY.rglob("*.json"):
        assert isinstance(json.loads(path.read_text()), dict)


def test_expected_kubernetes_objects_exist():
    kinds = {
        doc["kind"]
        for path in (DEPLOY / "k8s").glob("*.yaml")
        for doc in _docs(path)
        if isinstance(doc, dict) and "kind" in doc
    }
    assert {"Deployment", "Service", "ServiceMonitor", "HorizontalPodAutoscaler"} <= kinds
    for kind in ("Deployment", "Service", "ServiceMonitor", "HorizontalPodAutoscaler"):
        assert _one(kind)["metadata"]["name"] == "tessera"


# ---- the Deployment ------------------------------------------------------------------------


def test_probes_hit_health_on_the_serving_port():
    container = _container()
    [port] = container["ports"]
    assert port["containerPort"] == 8000
    for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
        http_get = container[probe]["httpGet"]
        assert http_get["path"] == "/health", probe
        assert http_get["port"] in (port["name"], port["containerPort"]), probe


def test_runs_as_non_root_and_locked_down():
    pod = _one("Deployment")["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] != 0
    container = _container()["securityContext"]
    assert container["allowPrivilegeEscalation"] is False
    assert container["readOnlyRootFilesystem"] is True
    assert container["capabilities"]["drop"] == ["ALL"]
    # A read-only root needs writable scratch for the ipc:// sockets and the model cache.
    mounts = {m["mountPath"] for m in _container()["volumeMounts"]}
    assert {"/tmp", "/var/cache/tessera"} <= mounts


def test_gpu_resources_and_read_only_model_volume():
    container = _container()
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert container["resources"]["requests"]["nvidia.com/gpu"] == 1
    assert "memory" in container["resources"]["limits"]
    [models] = [m for m in container["volumeMounts"] if m["mountPath"] == "/models"]
    assert models["readOnly"] is True
    volumes = {v["name"]: v for v in _one("Deployment")["spec"]["template"]["spec"]["volumes"]}
    assert volumes[models["name"]]["persistentVolumeClaim"]["readOnly"] is True


def _deployment_settings():
    settings = pytest.importorskip("server.settings")
    args = _container()["args"]
    config_in_image = args[args.index("--config") + 1]
    assert config_in_image.startswith("/etc/tessera/"), "configs/ is copied to /etc/tessera"
    local = ROOT / "configs" / Path(config_in_image).name
    assert local.is_file(), f"the Deployment uses {config_in_image}, not in configs/"
    rest = [
        a
        for i, a in enumerate(args)
        if i not in (args.index("--config"), args.index("--config") + 1)
    ]
    environ = {e["name"]: e["value"] for e in _container()["env"] if "value" in e}
    return settings.load_settings(["--config", str(local), *rest], environ)


def test_grace_period_covers_pre_stop_and_the_servers_drain():
    pod = _one("Deployment")["spec"]["template"]["spec"]
    pre_stop = _container()["lifecycle"]["preStop"]["exec"]["command"]
    assert pre_stop[0] == "sleep"
    settings = _deployment_settings()
    margin = 10  # the engine's own shutdown after the drain
    needed = int(pre_stop[1]) + settings.shutdown_timeout_s + margin
    assert pod["terminationGracePeriodSeconds"] >= needed


def test_deployment_settings_serve_the_mounted_model():
    settings = _deployment_settings()
    assert settings.engine.model.startswith("/models/")
    assert settings.host == "0.0.0.0" and settings.port == 8000
    assert settings.engine.device == "cuda"


# ---- Service, ServiceMonitor, HPA, adapter -------------------------------------------------


def test_service_and_service_monitor_select_the_pods():
    pod_labels = _one("Deployment")["spec"]["template"]["metadata"]["labels"]
    service = _one("Service")
    assert service["spec"]["selector"].items() <= pod_labels.items()
    [port] = service["spec"]["ports"]
    assert port["targetPort"] == _container()["ports"][0]["name"]
    monitor = _one("ServiceMonitor")
    assert (
        monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    )
    [endpoint] = monitor["spec"]["endpoints"]
    assert endpoint["port"] == port["name"] and endpoint["path"] == "/metrics"


def _adapter_name(rule: dict, series: str) -> str | None:
    """The custom-metrics name prometheus-adapter gives `series` under `rule`."""
    name = rule.get("name", {})
    pattern = name.get("matches", "^(.*)$")
    if not re.search(pattern, series):
        return None
    replacement = re.sub(r"\$\{?(\d+)\}?", r"\\\1", name.get("as", "${1}"))
    return re.sub(pattern, replacement, series)


def test_hpa_scales_on_queue_depth_through_the_adapter():
    hpa = _one("HorizontalPodAutoscaler")
    assert hpa["spec"]["scaleTargetRef"] == {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "name": "tessera",
    }
    assert 1 <= hpa["spec"]["minReplicas"] < hpa["spec"]["maxReplicas"]
    [metric] = hpa["spec"]["metrics"]
    assert metric["type"] == "Pods"
    hpa_name = metric["pods"]["metric"]["name"]
    sources = []
    for rule in _adapter_rules():
        for series in METRIC_RE.findall(rule["seriesQuery"]):
            if _adapter_name(rule, series) == hpa_name:
                sources.append(series)
    assert sources == ["tessera:num_requests_waiting"], (
        f"no adapter rule serves {hpa_name} from tessera:num_requests_waiting"
    )


def test_adapter_rules_are_per_pod():
    for rule in _adapter_rules():
        overrides = rule["resources"]["overrides"]
        assert overrides["pod"] == {"resource": "pod"}
        assert overrides["namespace"] == {"resource": "namespace"}
        assert "<<.Series>>" in rule["metricsQuery"]


# ---- metric names everywhere ----------------------------------------------------------------


def _all_metric_references() -> dict[str, list[str]]:
    references: dict[str, list[str]] = {
        "grafana/tessera.json": [m for e in _dashboard_exprs() for m in METRIC_RE.findall(e)],
        "k8s/hpa.yaml": [],
        "k8s/prometheus-adapter-values.yaml": [],
    }
    for rule in _adapter_rules():
        references["k8s/prometheus-adapter-values.yaml"] += METRIC_RE.findall(rule["seriesQuery"])
    references["k8s/hpa.yaml"] = METRIC_RE.findall((DEPLOY / "k8s" / "hpa.yaml").read_text())
    return references


def test_every_referenced_metric_exists():
    references = _all_metric_references()
    assert references["grafana/tessera.json"] and references["k8s/prometheus-adapter-values.yaml"]
    for where, names in references.items():
        unknown = sorted(set(names) - SERIES_NAMES)
        assert not unknown, f"{where} uses metrics that server/metric_names.py lacks: {unknown}"


def test_dashboard_covers_the_key_signals():
    exprs = "\n".join(_dashboard_exprs())
    for histogram in (
        "time_to_first_token_seconds",
        "inter_token_latency_seconds",
        "feature_fetch_seconds",
    ):
        assert f"histogram_quantile(0.99, sum by (le) (rate(tessera:{histogram}_bucket" in exprs
    assert "sum by (le, modality) (rate(tessera:media_preprocess_seconds_bucket" in exprs
    for series in (
        "tessera:prompt_tokens_total",
        "tessera:generation_tokens_total",
        "tessera:num_requests_waiting",
        "tessera:num_requests_running",
        "tessera:kv_cache_usage_perc",
        "tessera:prefix_cache_hits_total",
        "tessera:encoder_cache_hits_total",
    ):
        assert series in exprs, series
    # Histograms are only ever read through their _bucket/_sum/_count series.
    for name in METRIC_RE.findall(exprs):
        assert METRICS_BY_NAME.get(name, None) is None or METRICS_BY_NAME[name].type != "histogram"


def test_dashboard_filters_on_model_name_and_uses_the_provisioned_datasource():
    for expr in _dashboard_exprs():
        if "label_values" not in expr:
            assert '{model_name=~"$model_name"}' in expr, expr
    [datasource] = _docs(DEPLOY / "grafana" / "provisioning" / "datasources" / "prometheus.yaml")
    uid = datasource["datasources"][0]["uid"]
    variables = {v["name"]: v for v in _dashboard()["templating"]["list"]}
    assert variables["datasource"]["current"]["value"] == uid
    ids = [panel["id"] for panel in _dashboard()["panels"]]
    assert len(ids) == len(set(ids))


def test_metric_names_are_well_formed():
    names = [spec.name for spec in METRICS]
    assert len(names) == len(set(names))
    for spec in METRICS:
        assert spec.name.startswith("tessera:") and spec.help
        assert spec.labels[0] == MODEL_LABEL
        assert spec.name.endswith("_total") == (spec.type == "counter"), spec.name
        if spec.type == "histogram":
            assert spec.buckets and list(spec.buckets) == sorted(set(spec.buckets))
            assert not spec.client_name.endswith("_total")
        else:
            assert not spec.buckets
    assert METRICS_BY_NAME["tessera:request_success_total"].labels == (
        MODEL_LABEL,
        "finished_reason",
    )
    assert METRICS_BY_NAME["tessera:http_requests_total"].labels == (MODEL_LABEL, "route", "status")
    assert METRICS_BY_NAME["tessera:prompt_tokens_total"].client_name == "tessera:prompt_tokens"


def test_metric_specs_build_a_prometheus_registry():
    prometheus_client = pytest.importorskip("prometheus_client")
    registry = prometheus_client.CollectorRegistry()
    kinds = {
        "counter": prometheus_client.Counter,
        "gauge": prometheus_client.Gauge,
        "histogram": prometheus_client.Histogram,
    }
    for spec in METRICS:
        extra = {"buckets": spec.buckets} if spec.type == "histogram" else {}
        metric = kinds[spec.type](
            spec.client_name, spec.help, spec.labels, registry=registry, **extra
        )
        metric.labels(*["x"] * len(spec.labels))
    text = prometheus_client.generate_latest(registry).decode()
    exported = {
        line.split("{")[0].split(" ")[0]
        for line in text.splitlines()
        if line and not line.startswith("#")
    }
    assert SERIES_NAMES <= exported


def test_docs_metrics_table_is_current():
    docs = (ROOT / "docs" / "deploy.md").read_text()
    assert markdown_table() in docs, (
        "regenerate the table: python -c "
        "'from server.metric_names import markdown_table; print(markdown_table())'"
    )
    assert vllm_porting_table() in docs, "regenerate the vLLM table (vllm_porting_table)"


# The families and histogram boundaries a vLLM 0.32 (CPU) server exports, from a scrape
# and vllm/v1/metrics/buckets.py (fuzz105).
VLLM_032_FAMILIES = """num_requests_running num_requests_waiting num_requests_waiting_by_reason
kv_cache_usage_perc num_preemptions_total prompt_tokens_total generation_tokens_total
prompt_tokens_cached_total prompt_tokens_by_source_total request_success_total
prefix_cache_queries_total prefix_cache_hits_total mm_cache_queries_total mm_cache_hits_total
admission_rejections_total cache_config_info engine_sleep_state time_to_first_token_seconds
inter_token_latency_seconds e2e_request_latency_seconds request_time_per_output_token_seconds
request_queue_time_seconds request_inference_time_seconds request_prefill_time_seconds
request_decode_time_seconds request_prompt_tokens request_generation_tokens
iteration_tokens_total request_max_num_generation_tokens request_params_n
request_params_max_tokens request_num_preemptions request_prefill_kv_computed_tokens""".split()
VLLM_032_LATENCY_BOUNDARIES = (
    (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
     240.0, 480.0, 960.0, 1920.0, 7680.0),  # request phases
    (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
     10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0),  # time to first token
    (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
     20.0, 40.0, 80.0),  # inter-token
)  # fmt: skip


def test_a_dashboard_ported_from_vllm_finds_its_families_and_buckets():
    """Renaming `vllm:` to `tessera:` finds each family, or VLLM_COUNTERPARTS says where it
    went; an alert on any of vLLM's `le` boundaries finds its bucket (fuzz105: 16
    families and most boundaries were missing, undocumented)."""
    for name in VLLM_032_FAMILIES:
        assert f"tessera:{name}" in METRICS_BY_NAME or f"vllm:{name}" in VLLM_COUNTERPARTS, name
    for where in VLLM_COUNTERPARTS.values():
        for named in re.findall(r"`(tessera:[a-z_]+)`", where):
            assert named in METRICS_BY_NAME, named
    # a family Tessera has under vLLM's own name needs no entry (fuzz106: this compared
    # bare names with `vllm:` keys and could not fail)
    same_name = {"vllm:" + spec.name.removeprefix("tessera:") for spec in METRICS}
    assert not same_name & set(VLLM_COUNTERPARTS)
    latency = {spec.buckets for spec in METRICS if spec.name.endswith("_seconds")}
    assert latency == {LATENCY_BUCKETS}
    for boundaries in VLLM_032_LATENCY_BOUNDARIES:
        assert set(boundaries) <= set(LATENCY_BUCKETS)
    vllm_tokens = {1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384}  # iteration
    vllm_tokens |= {m * 10**e for e in range(5) for m in (1, 2, 5)}  # 1-2-5 per request
    assert vllm_tokens <= set(TOKEN_BUCKETS) and list(TOKEN_BUCKETS) == sorted(TOKEN_BUCKETS)
    assert list(LATENCY_BUCKETS) == sorted(LATENCY_BUCKETS)


# ---- local stack -----------------------------------------------------------------------------


def test_compose_stack_wires_tessera_prometheus_grafana():
    [compose] = _docs(DEPLOY / "docker-compose.yaml")
    services = compose["services"]
    assert {"tessera", "prometheus", "grafana"} <= set(services)
    build = services["tessera"]["build"]
    assert (DEPLOY / build["context"] / build["dockerfile"]).is_file()
    for service in services.values():
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            if source.startswith("."):
                assert (DEPLOY / source).exists(), f"compose mounts missing {source}"
    [prometheus] = _docs(DEPLOY / "prometheus" / "prometheus.yml")
    [job] = [j for j in prometheus["scrape_configs"] if j["job_name"] == "tessera"]
    assert job["metrics_path"] == "/metrics"
    [target] = job["static_configs"][0]["targets"]
    assert target == "tessera:8000", "the scrape target is the compose service"
    [provider] = _docs(DEPLOY / "grafana" / "provisioning" / "dashboards" / "tessera.yaml")
    dashboards_dir = provider["providers"][0]["options"]["path"]
    grafana_mounts = [v.split(":")[1] for v in services["grafana"]["volumes"]]
    assert f"{dashboards_dir}/tessera.json" in grafana_mounts
