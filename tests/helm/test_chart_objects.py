"""What the rendered objects say: probes, GPUs, security, secrets, hooks, selectors,
network policies, graceful termination, and settings the services actually read."""

from __future__ import annotations

import helm_python as helm
import pytest

from executor_service.config import ExecutorSettings
from registry_service.config import RegistrySettings
from tests.helm.chart import (
    EXECUTOR_SERVICE,
    REGISTRY_SERVICE,
    Obj,
    Release,
    component_of,
    configmap_env,
    container,
    containers,
    env_of,
    pod_template,
    render,
    selector_matches,
)

GPU = "nvidia.com/gpu"
# Names whose value must come from a Secret, never from the chart's text.
SECRET_ENV = (
    "MOELORA_REGISTRY_DATABASE_URL",
    "MOELORA_EXECUTOR_REGISTRY_TOKEN",
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
)


def releases(*fixtures: str) -> pytest.MarkDecorator:
    return pytest.mark.parametrize("release_name", fixtures)


@pytest.fixture
def release(request: pytest.FixtureRequest, release_name: str) -> Release:
    rendered: Release = request.getfixturevalue(release_name)
    return rendered


def pod_labels(workload: Obj) -> dict[str, str]:
    return dict(pod_template(workload)["metadata"]["labels"])


def port_number(c: Obj, name: str) -> int:
    return int(next(p["containerPort"] for p in c["ports"] if p["name"] == name))


# --- probes -------------------------------------------------------------------------


@releases("defaults", "production", "cpu")
def test_executor_probes_are_native_grpc_health_checks(release: Release) -> None:
    statefulset = release.one("StatefulSet")
    executor = container(statefulset, "executor")
    port = port_number(executor, "grpc")
    assert port == 50052
    for probe in ("startupProbe", "readinessProbe"):
        assert executor[probe]["grpc"] == {"port": port, "service": EXECUTOR_SERVICE}
    # Liveness asks about the server as a whole.
    assert executor["livenessProbe"]["grpc"] == {"port": port}
    assert configmap_env(release, executor)["MOELORA_EXECUTOR_LISTEN"] == f"0.0.0.0:{port}"


def test_startup_probe_budget_covers_model_loading(defaults: Release, production: Release) -> None:
    for release, budget in ((defaults, 1800), (production, 3600)):
        startup = container(release.one("StatefulSet"), "executor")["startupProbe"]
        assert startup["periodSeconds"] * startup["failureThreshold"] >= budget
        assert startup["periodSeconds"] * (startup["failureThreshold"] - 1) < budget


@releases("defaults", "production")
def test_registry_probes_are_native_grpc_health_checks(release: Release) -> None:
    registry = container(release.one("Deployment", "registry"), "registry")
    port = port_number(registry, "grpc")
    assert port == 50051
    for probe in ("startupProbe", "readinessProbe"):
        assert registry[probe]["grpc"] == {"port": port, "service": REGISTRY_SERVICE}
    assert registry["livenessProbe"]["grpc"] == {"port": port}
    assert configmap_env(release, registry)["MOELORA_REGISTRY_LISTEN"] == f"0.0.0.0:{port}"


# --- services -----------------------------------------------------------------------


@releases("defaults", "production")
def test_services_speak_grpc_and_select_their_pods(release: Release) -> None:
    for component, workload_kind in (("registry", "Deployment"), ("executor", "StatefulSet")):
        service = release.one("Service", component)
        workload = release.one(workload_kind, component)
        assert selector_matches({"matchLabels": service["spec"]["selector"]}, pod_labels(workload))
        grpc_port = next(p for p in service["spec"]["ports"] if p["name"] == "grpc")
        assert grpc_port["appProtocol"] == "grpc"
        assert grpc_port["targetPort"] == "grpc"
    headless = release.one("Service", "executor")
    assert headless["spec"]["clusterIP"] == "None"
    assert headless["spec"]["publishNotReadyAddresses"] is False
    assert release.one("StatefulSet")["spec"]["serviceName"] == headless["metadata"]["name"]


# --- GPUs and scheduling ------------------------------------------------------------


@releases("defaults", "production", "autoscaling")
def test_executors_ask_for_a_gpu(release: Release) -> None:
    resources = container(release.one("StatefulSet"), "executor")["resources"]
    assert resources["limits"][GPU] == 1
    assert resources["requests"][GPU] == 1
    tolerations = pod_template(release.one("StatefulSet"))["spec"]["tolerations"]
    assert {"key": GPU, "operator": "Exists", "effect": "NoSchedule"} in tolerations


def test_production_executors_land_on_the_chosen_gpu_nodes(production: Release) -> None:
    spec = pod_template(production.one("StatefulSet"))["spec"]
    assert spec["runtimeClassName"] == "nvidia"
    assert spec["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}
    assert spec["priorityClassName"] == "inference-critical"
    assert production.one("StatefulSet")["spec"]["replicas"] == 4
    assert production.one("StatefulSet")["spec"]["podManagementPolicy"] == "Parallel"


def test_cpu_executors_ask_for_no_gpu(cpu: Release) -> None:
    executor = container(cpu.one("StatefulSet"), "executor")
    assert GPU not in executor["resources"].get("limits", {})
    assert GPU not in executor["resources"].get("requests", {})
    assert configmap_env(cpu, executor)["MOELORA_EXECUTOR_DEVICE"] == "cpu"
    assert "tolerations" not in pod_template(cpu.one("StatefulSet"))["spec"]


@releases("defaults", "production")
def test_dev_shm_is_a_sized_memory_volume(release: Release) -> None:
    statefulset = release.one("StatefulSet")
    volumes = {v["name"]: v for v in pod_template(statefulset)["spec"]["volumes"]}
    mounts = {m["mountPath"]: m["name"] for m in container(statefulset, "executor")["volumeMounts"]}
    shm = volumes[mounts["/dev/shm"]]["emptyDir"]
    assert shm["medium"] == "Memory"
    assert shm["sizeLimit"] in ("8Gi", "16Gi")


# --- security -----------------------------------------------------------------------


@releases("defaults", "production", "autoscaling", "cpu")
def test_every_pod_runs_non_root_read_only_without_capabilities(release: Release) -> None:
    for workload in release.workloads():
        spec = pod_template(workload)["spec"]
        assert spec["securityContext"]["runAsNonRoot"] is True
        assert spec["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
        assert spec["automountServiceAccountToken"] is False
        for c in containers(workload):
            ctx = c["securityContext"]
            assert ctx["allowPrivilegeEscalation"] is False, c["name"]
            assert ctx["readOnlyRootFilesystem"] is True, c["name"]
            assert ctx["capabilities"]["drop"] == ["ALL"], c["name"]


@releases("defaults", "production", "cpu")
def test_services_get_writable_tmp_and_home_volumes(release: Release) -> None:
    # The root filesystem is read-only: whatever a service writes goes to a volume.
    for workload in release.workloads():
        if workload["kind"] == "Pod":  # the helm test probe writes nothing
            continue
        for c in containers(workload):
            paths = {m["mountPath"] for m in c["volumeMounts"]}
            assert {"/tmp", "/home/moelora"} <= paths, c["name"]
    executor = container(release.one("StatefulSet"), "executor")
    env = configmap_env(release, executor)
    cache_paths = {m["mountPath"] for m in executor["volumeMounts"]}
    assert env["MOELORA_EXECUTOR_DISK_CACHE_DIR"].startswith("/var/cache/moelora/")
    assert env["TRITON_CACHE_DIR"].startswith("/var/cache/moelora/")
    assert "/var/cache/moelora" in cache_paths


@releases("defaults", "production", "cpu")
def test_secrets_are_referenced_never_inlined(release: Release) -> None:
    assert release.all("Secret") == []
    for workload in release.workloads():
        for c in containers(workload):
            for name, entry in env_of(c).items():
                if name in SECRET_ENV:
                    assert "value" not in entry, f"{c['name']}: {name} inlined"
                    assert "secretKeyRef" in entry["valueFrom"]
    for configmap in release.all("ConfigMap"):
        for key, value in configmap["data"].items():
            assert key not in SECRET_ENV
            assert "postgresql" not in value, key


def test_production_secrets_come_from_the_named_secrets(production: Release) -> None:
    registry = container(production.one("Deployment", "registry"), "registry")
    env = env_of(registry)
    assert env["MOELORA_REGISTRY_DATABASE_URL"]["valueFrom"]["secretKeyRef"] == {
        "name": "moelora-database",
        "key": "database-url",
    }
    assert env["AWS_SECRET_ACCESS_KEY"]["valueFrom"]["secretKeyRef"]["name"] == "moelora-s3"
    token = env_of(container(production.one("StatefulSet"), "executor"))[
        "MOELORA_EXECUTOR_REGISTRY_TOKEN"
    ]
    assert token["valueFrom"]["secretKeyRef"] == {"name": "moelora-executor-token", "key": "token"}
    # The hashed token file is mounted from its Secret, where ..._AUTH_TOKENS_FILE says.
    spec = pod_template(production.one("Deployment", "registry"))["spec"]
    volume = next(v for v in spec["volumes"] if "secret" in v)
    assert volume["secret"]["secretName"] == "moelora-registry-tokens"
    mount = next(m for m in registry["volumeMounts"] if m["name"] == volume["name"])
    assert mount["readOnly"] is True
    tokens_file = configmap_env(production, registry)["MOELORA_REGISTRY_AUTH_TOKENS_FILE"]
    assert tokens_file == f"{mount['mountPath']}/tokens.json"
    assert configmap_env(production, registry)["MOELORA_REGISTRY_AUTH"] == "on"


# --- settings the services read -----------------------------------------------------


@releases("defaults", "production", "autoscaling", "cpu")
def test_every_moelora_variable_is_a_setting_of_its_service(release: Release) -> None:
    known = {
        "registry": set(RegistrySettings.env_names().values()),
        "migrate": set(RegistrySettings.env_names().values()),
        # The model fetcher reads the registry's S3 settings.
        "fetch-model": set(RegistrySettings.env_names().values()),
        "executor": set(ExecutorSettings.env_names().values()),
    }
    for workload in release.workloads():
        for c in containers(workload):
            names = set(env_of(c)) | set(configmap_env(release, c))
            used = {n for n in names if n.startswith("MOELORA_")}
            if c["name"] in known:
                assert used <= known[c["name"]], f"{c['name']}: unknown {used - known[c['name']]}"


def test_executor_settings_follow_the_values(production: Release) -> None:
    env = configmap_env(production, container(production.one("StatefulSet"), "executor"))
    assert env["MOELORA_EXECUTOR_BASE_MODEL_NAME"] == "qwen3-30b-a3b"
    assert env["MOELORA_EXECUTOR_NUM_SLOTS"] == "32"
    assert env["MOELORA_EXECUTOR_MAX_RANK"] == "64"
    assert env["MOELORA_EXECUTOR_FP8_ACTIVATIONS"] == "false"
    assert env["MOELORA_EXECUTOR_HOST_CACHE_BYTES"] == str(32 * 1024**3)
    assert env["MOELORA_EXECUTOR_DISK_CACHE_BYTES"] == str(100 * 1024**3)
    assert env["MOELORA_EXECUTOR_PRELOAD_ADAPTERS"] == '["support-bot@prod","sql-writer@prod"]'
    assert env["MOELORA_EXECUTOR_REGISTRY_ADDRESS"] == "demo-moe-lora-serve-registry.ml.svc:50051"
    # The adapter disk cache fits its volume.
    statefulset = production.one("StatefulSet")
    cache = next(v for v in pod_template(statefulset)["spec"]["volumes"] if v["name"] == "cache")
    assert int(cache["emptyDir"]["sizeLimit"].removesuffix("Gi")) * 1024**3 > int(
        env["MOELORA_EXECUTOR_DISK_CACHE_BYTES"]
    )


# --- graceful termination -----------------------------------------------------------


@releases("defaults", "production")
def test_termination_grace_outlasts_the_pause_and_the_drain(release: Release) -> None:
    for workload in (release.one("StatefulSet"), release.one("Deployment", "registry")):
        spec = pod_template(workload)["spec"]
        main = spec["containers"][0]
        env = configmap_env(release, main)
        drain = float(
            env.get("MOELORA_EXECUTOR_DRAIN_SECONDS") or env["MOELORA_REGISTRY_DRAIN_SECONDS"]
        )
        pause = main["lifecycle"]["preStop"]["sleep"]["seconds"]
        assert spec["terminationGracePeriodSeconds"] > pause + drain
        liveness = main["livenessProbe"]
        assert liveness["periodSeconds"] * liveness["failureThreshold"] > pause + drain


# --- the registry: database, migrations, replicas -----------------------------------


def test_sqlite_registry_is_one_pod_on_a_kept_volume_migrating_at_start(
    defaults: Release,
) -> None:
    deployment = defaults.one("Deployment", "registry")
    assert deployment["spec"]["replicas"] == 1
    assert deployment["spec"]["strategy"]["type"] == "Recreate"
    assert defaults.all("Job") == []
    env = configmap_env(defaults, container(deployment, "registry"))
    assert env["MOELORA_REGISTRY_MIGRATE_ON_START"] == "true"
    assert env["MOELORA_REGISTRY_BLOB_URL"] == "file:///data/blobs"
    claim = defaults.one("PersistentVolumeClaim")
    assert claim["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    data = next(v for v in pod_template(deployment)["spec"]["volumes"] if v["name"] == "data")
    assert data["persistentVolumeClaim"]["claimName"] == claim["metadata"]["name"]
    assert defaults.all("PodDisruptionBudget") == [defaults.one("PodDisruptionBudget", "executor")]


def test_postgresql_registry_migrates_in_a_hook_job_before_pods_roll(production: Release) -> None:
    job = production.one("Job", "migration")
    annotations = job["metadata"]["annotations"]
    assert annotations["helm.sh/hook"] == "pre-install,pre-upgrade"
    assert "before-hook-creation" in annotations["helm.sh/hook-delete-policy"]
    migrate = container(job, "migrate")
    assert migrate["args"] == ["migrate"]
    assert migrate["image"] == container(production.one("Deployment"), "registry")["image"]
    # Hooks run before the release's own objects exist: nothing from the chart is used.
    assert "envFrom" not in migrate
    assert "serviceAccountName" not in pod_template(job)["spec"]
    assert "secretKeyRef" in env_of(migrate)["MOELORA_REGISTRY_DATABASE_URL"]["valueFrom"]
    deployment = production.one("Deployment", "registry")
    env = configmap_env(production, container(deployment, "registry"))
    assert env["MOELORA_REGISTRY_MIGRATE_ON_START"] == "false"
    assert env["MOELORA_REGISTRY_BLOB_URL"] == "s3://moelora-adapters/prod"
    assert deployment["spec"]["replicas"] == 3
    assert deployment["spec"]["strategy"]["type"] == "RollingUpdate"
    assert production.all("PersistentVolumeClaim") == []
    # /data then holds only the upload spool: a sized emptyDir.
    volumes = {v["name"]: v for v in pod_template(deployment)["spec"]["volumes"]}
    assert volumes["data"]["emptyDir"] == {"sizeLimit": "20Gi"}
    assert env["MOELORA_REGISTRY_DATA_DIR"] == "/data"


# --- disruption budgets and autoscaling ---------------------------------------------


@releases("defaults", "production", "autoscaling")
def test_disruption_budgets_select_exactly_their_pods(release: Release) -> None:
    budgets = release.all("PodDisruptionBudget")
    assert budgets
    for pdb in budgets:
        component = component_of(pdb)
        for workload in release.workloads():
            matched = selector_matches(pdb["spec"]["selector"], pod_labels(workload))
            assert matched == (component_of(workload) == component), workload["metadata"]["name"]


def test_production_registry_has_a_budget(production: Release) -> None:
    assert production.one("PodDisruptionBudget", "registry")["spec"]["maxUnavailable"] == 1


def test_hpa_scales_the_executor_statefulset(autoscaling: Release) -> None:
    hpa = autoscaling.one("HorizontalPodAutoscaler")
    statefulset = autoscaling.one("StatefulSet")
    target = hpa["spec"]["scaleTargetRef"]
    assert (target["kind"], target["name"]) == ("StatefulSet", statefulset["metadata"]["name"])
    assert "replicas" not in statefulset["spec"]  # the HPA owns the count
    assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (2, 8)
    assert hpa["spec"]["metrics"][0]["type"] == "Pods"
    assert hpa["spec"]["behavior"]["scaleDown"]["stabilizationWindowSeconds"] >= 300


# --- base model sources -------------------------------------------------------------


def test_model_from_s3_is_fetched_by_an_init_container_onto_a_pod_volume(
    production: Release,
) -> None:
    statefulset = production.one("StatefulSet")
    fetch = container(statefulset, "fetch-model")
    assert fetch["args"] == ["s3://moelora-models/qwen3-30b-a3b", "/models"]
    assert fetch["image"].startswith("moelora/registry:")  # boto3 lives there
    assert (
        env_of(fetch)["MOELORA_REGISTRY_S3_ENDPOINT_URL"]["value"]
        == "https://minio.storage.svc:9000"
    )
    claim = statefulset["spec"]["volumeClaimTemplates"][0]
    assert claim["metadata"]["name"] == "model"
    assert claim["spec"]["resources"]["requests"]["storage"] == "120Gi"
    executor = container(statefulset, "executor")
    model_mount = next(m for m in executor["volumeMounts"] if m["name"] == "model")
    assert model_mount == {"name": "model", "mountPath": "/models", "readOnly": True}
    assert configmap_env(production, executor)["MOELORA_EXECUTOR_BASE_MODEL_PATH"] == "/models"


def test_model_from_s3_without_persistence_uses_a_sized_empty_dir(cpu: Release) -> None:
    statefulset = cpu.one("StatefulSet")
    assert "volumeClaimTemplates" not in statefulset["spec"]
    volumes = {v["name"]: v for v in pod_template(statefulset)["spec"]["volumes"]}
    assert volumes["model"]["emptyDir"] == {"sizeLimit": "2Gi"}


def test_model_from_host_path_is_read_only(autoscaling: Release) -> None:
    statefulset = autoscaling.one("StatefulSet")
    volumes = {v["name"]: v for v in pod_template(statefulset)["spec"]["volumes"]}
    assert volumes["model"]["hostPath"] == {"path": "/mnt/models", "type": "Directory"}
    executor = container(statefulset, "executor")
    env = configmap_env(autoscaling, executor)
    assert env["MOELORA_EXECUTOR_BASE_MODEL_PATH"] == "/models/Mixtral-8x7B-v0.1"
    assert not [c for c in containers(statefulset) if c["name"] == "fetch-model"]


def test_model_from_pvc_is_mounted_read_only(defaults: Release) -> None:
    volumes = {v["name"]: v for v in pod_template(defaults.one("StatefulSet"))["spec"]["volumes"]}
    assert volumes["model"]["persistentVolumeClaim"] == {
        "claimName": "base-model",
        "readOnly": True,
    }


# --- network policies ---------------------------------------------------------------


def policy_for(release: Release, component: str) -> Obj:
    return release.one("NetworkPolicy", component)


def egress_ports(policy: Obj) -> set[int]:
    return {p["port"] for rule in policy["spec"].get("egress", []) for p in rule.get("ports", [])}


def admitted(rule: Obj, labels: dict[str, str]) -> bool:
    """Whether a pod in the release's namespace with ``labels`` matches one ``from`` peer
    that has no namespaceSelector."""
    return any(
        "namespaceSelector" not in peer and selector_matches(peer["podSelector"], labels)
        for peer in rule.get("from", [])
    )


@releases("defaults", "production")
def test_only_labelled_clients_and_the_test_pod_reach_executors(release: Release) -> None:
    policy = policy_for(release, "executor")
    statefulset = release.one("StatefulSet")
    assert selector_matches(policy["spec"]["podSelector"], pod_labels(statefulset))
    grpc_rule = next(r for r in policy["spec"]["ingress"] if r["ports"][0]["port"] == "grpc")
    test_pod = release.one("Pod", "test")
    assert admitted(grpc_rule, test_pod["metadata"]["labels"])
    assert not admitted(grpc_rule, {"app": "anything-else"})
    assert not admitted(grpc_rule, pod_labels(release.one("Deployment", "registry")))
    client_peer = grpc_rule["from"][0]
    assert client_peer["podSelector"] == {"matchLabels": {"moelora.io/executor-client": "true"}}


def test_executor_clients_may_come_from_another_namespace(production: Release) -> None:
    grpc_rule = policy_for(production, "executor")["spec"]["ingress"][0]
    assert grpc_rule["from"][0]["namespaceSelector"] == {
        "matchLabels": {"kubernetes.io/metadata.name": "engine"}
    }


@releases("defaults", "production")
def test_registry_admits_its_executors_clients_and_test_pod(release: Release) -> None:
    policy = policy_for(release, "registry")
    grpc_rule = next(r for r in policy["spec"]["ingress"] if r["ports"][0]["port"] == "grpc")
    assert admitted(grpc_rule, pod_labels(release.one("StatefulSet")))
    assert admitted(grpc_rule, release.one("Pod", "test")["metadata"]["labels"])
    assert admitted(grpc_rule, {"moelora.io/registry-client": "true"})
    assert not admitted(grpc_rule, {"app": "anything-else"})


@releases("defaults", "production")
def test_local_blobs_serve_signed_urls_to_executors_through_the_service(
    release: Release,
) -> None:
    registry = container(release.one("Deployment", "registry"), "registry")
    env = configmap_env(release, registry)
    service = release.one("Service", "registry")
    service_ports = {p["name"]: p for p in service["spec"]["ports"]}
    registry_rule = next(
        r
        for r in policy_for(release, "registry")["spec"]["ingress"]
        if r["ports"][0]["port"] == "grpc"
    )
    executor_egress = egress_ports(policy_for(release, "executor"))
    if not env["MOELORA_REGISTRY_BLOB_URL"].startswith("file://"):  # S3: executors go to the bucket
        assert env["MOELORA_REGISTRY_HTTP_LISTEN"] == ""
        assert "http" not in service_ports
        assert [p["name"] for p in registry["ports"]] == ["grpc", "metrics"]
        assert "http" not in {p["port"] for p in registry_rule["ports"]}
        assert 50053 not in executor_egress
        return
    port = port_number(registry, "http")
    assert port == 50053 and env["MOELORA_REGISTRY_HTTP_LISTEN"] == f"0.0.0.0:{port}"
    assert service_ports["http"]["port"] == port and service_ports["http"]["targetPort"] == "http"
    name, namespace = service["metadata"]["name"], service["metadata"]["namespace"]
    assert env["MOELORA_REGISTRY_HTTP_PUBLIC_URL"] == f"http://{name}.{namespace}.svc:{port}"
    assert {"port": "http", "protocol": "TCP"} in registry_rule["ports"]
    assert admitted(registry_rule, pod_labels(release.one("StatefulSet")))
    assert port in executor_egress


def test_only_the_registry_reaches_the_database(production: Release) -> None:
    registry_policy = policy_for(production, "registry")
    executor_policy = policy_for(production, "executor")
    # The registry's egress (its policy also selects the migration Job) includes the
    # database port; the executors' egress never does.
    assert selector_matches(
        registry_policy["spec"]["podSelector"], pod_labels(production.one("Job"))
    )
    assert 5432 in egress_ports(registry_policy)
    assert 5432 not in egress_ports(executor_policy)
    assert {53, 50051, 9000} <= egress_ports(executor_policy)
    # The in-cluster database admits the registry and the migration Job, nobody else.
    database_policy = production.one("NetworkPolicy", "database")
    assert database_policy["spec"]["podSelector"] == {
        "matchLabels": {"app.kubernetes.io/name": "postgresql"}
    }
    (rule,) = database_policy["spec"]["ingress"]
    assert rule["ports"] == [{"port": 5432, "protocol": "TCP"}]
    assert admitted(rule, pod_labels(production.one("Deployment", "registry")))
    assert admitted(rule, pod_labels(production.one("Job")))
    assert not admitted(rule, pod_labels(production.one("StatefulSet")))
    assert not admitted(rule, production.one("Pod", "test")["metadata"]["labels"])


def test_metrics_scrapers_are_limited_when_configured(production: Release) -> None:
    for component in ("registry", "executor"):
        ingress = policy_for(production, component)["spec"]["ingress"]
        metrics_rule = next(r for r in ingress if r["ports"][0]["port"] == "metrics")
        assert metrics_rule["from"] == [
            {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}
        ]


def test_network_policies_can_be_turned_off(cpu: Release) -> None:
    assert cpu.all("NetworkPolicy") == []


# --- monitoring ---------------------------------------------------------------------


def test_service_monitors_scrape_the_services_metrics_ports(production: Release) -> None:
    monitors = production.all("ServiceMonitor")
    assert {component_of(m) for m in monitors} == {"registry", "executor"}
    for monitor in monitors:
        assert monitor["metadata"]["labels"]["release"] == "kube-prometheus-stack"
        service = production.one("Service", component_of(monitor))
        assert selector_matches(monitor["spec"]["selector"], service["metadata"]["labels"])
        port_names = {p["name"] for p in service["spec"]["ports"]}
        assert [e["port"] for e in monitor["spec"]["endpoints"]] == ["metrics"]
        assert "metrics" in port_names
    assert production.all("PodMonitor") == []


def test_pod_monitors_scrape_the_pods_metrics_ports(autoscaling: Release) -> None:
    monitors = autoscaling.all("PodMonitor")
    assert {component_of(m) for m in monitors} == {"registry", "executor"}
    for monitor in monitors:
        kind = "StatefulSet" if component_of(monitor) == "executor" else "Deployment"
        workload = autoscaling.one(kind, component_of(monitor))
        assert selector_matches(monitor["spec"]["selector"], pod_labels(workload))
        main = pod_template(workload)["spec"]["containers"][0]
        metrics_port = port_number(main, "metrics")
        env = configmap_env(autoscaling, main)
        listen = (
            env.get("MOELORA_EXECUTOR_METRICS_LISTEN") or env["MOELORA_REGISTRY_METRICS_LISTEN"]
        )
        assert listen == f"0.0.0.0:{metrics_port}"


def test_metrics_off_turns_the_endpoint_off(cpu: Release) -> None:
    executor = container(cpu.one("StatefulSet"), "executor")
    assert configmap_env(cpu, executor)["MOELORA_EXECUTOR_METRICS_LISTEN"] == ""
    assert [p["name"] for p in executor["ports"]] == ["grpc"]


# --- helm test and NOTES ------------------------------------------------------------


def test_helm_test_pod_checks_the_registry_and_every_executor(production: Release) -> None:
    pod = production.one("Pod", "test")
    assert pod["metadata"]["annotations"]["helm.sh/hook"] == "test"
    registry_check = container(pod, "registry-health")
    assert registry_check["command"] == ["python", "/opt/moelora/grpc_health_probe.py"]
    assert registry_check["args"] == [
        f"--service={REGISTRY_SERVICE}",
        "demo-moe-lora-serve-registry.ml.svc:50051",
    ]
    executor_check = container(pod, "executor-health")
    assert executor_check["args"] == [
        f"--service={EXECUTOR_SERVICE}",
        *(
            f"demo-moe-lora-serve-executor-{i}.demo-moe-lora-serve-executor-headless.ml.svc:50052"
            for i in range(4)
        ),
    ]


def test_helm_test_with_autoscaling_checks_the_minimum_executors(autoscaling: Release) -> None:
    args = container(autoscaling.one("Pod", "test"), "executor-health")["args"]
    assert len(args) == 1 + 2


def test_notes_tell_how_to_upload_an_adapter_and_call_forward(
    defaults: Release, production: Release
) -> None:
    notes = defaults.notes
    assert "kubectl -n ml port-forward svc/demo-moe-lora-serve-registry 50051:50051" in notes
    assert "adapterctl upload" in notes and "adapterctl base-model register" in notes
    assert "pip install moelora-client" in notes and "client.forward(" in notes
    assert "dns:///demo-moe-lora-serve-executor-headless.ml.svc:50052" in notes
    assert "admits only client pods labelled moelora.io/executor-client=true" in notes
    assert "WARNING: auth is off" in notes
    assert "WARNING" not in production.notes
    assert "MOELORA_REGISTRY_TOKEN" in production.notes


# --- names and images ---------------------------------------------------------------


def test_names_fit_kubernetes_limits_for_the_longest_release_name(chart: helm.Chart) -> None:
    longest = "r" * 53  # Helm's limit for release names
    release = render(chart, {}, release=longest)
    for obj in release.objects:
        assert len(obj["metadata"]["name"]) <= 63, obj["metadata"]["name"]
    # StatefulSet pods carry "NAME-<10-char hash>" as a label value (63 at most).
    assert len(release.one("StatefulSet")["metadata"]["name"]) <= 52


def test_an_image_digest_wins_over_the_tag(chart: helm.Chart) -> None:
    digest = "sha256:" + "ab" * 32
    release = render(chart, {"images": {"executor": {"digest": digest, "tag": "ignored"}}})
    assert container(release.one("StatefulSet"), "executor")["image"] == (
        f"moelora/executor@{digest}"
    )
    assert container(release.one("Deployment"), "registry")["image"] == "moelora/registry:0.1.0"


def test_no_executors_means_the_test_checks_only_the_registry(chart: helm.Chart) -> None:
    release = render(chart, {"executor": {"replicas": 0}})
    pod = release.one("Pod", "test")
    assert [c["name"] for c in pod["spec"]["containers"]] == ["registry-health"]
    assert release.one("StatefulSet")["spec"]["replicas"] == 0
