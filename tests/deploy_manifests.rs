//! The deployment artefacts keep their promises (docs/deploy.md): the
//! Kubernetes manifests run idemproxy as a native sidecar with the right
//! probes, secrets and hardening; the compose file waits for healthy
//! dependencies; the image is static, non-root and shell-free; and every
//! TOML they ship is a valid idemproxy configuration.
//!
//! The Kubernetes checks read `deploy/kubernetes/base/` as written. CI also
//! renders each overlay with kustomize and runs this file again with
//! `IDEMPROXY_RENDERED_MANIFESTS=<rendered.yaml>`, so that an overlay cannot
//! patch a promise away either.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use idemproxy::config::{self, Config, Overrides};
use serde::Deserialize;
use serde_norway::Value;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// Every YAML document in `text`.
fn documents(text: &str, origin: &str) -> Vec<Value> {
    serde_norway::Deserializer::from_str(text)
        .map(|doc| Value::deserialize(doc).unwrap_or_else(|e| panic!("{origin}: {e}")))
        .filter(|v| !v.is_null())
        .collect()
}

/// Kubernetes objects by `Kind/name`, and the sidecar's TOML.
struct Manifests {
    objects: BTreeMap<String, Value>,
    toml: String,
    origin: String,
}

impl Manifests {
    fn load() -> Manifests {
        match std::env::var_os("IDEMPROXY_RENDERED_MANIFESTS") {
            Some(path) => Self::rendered(Path::new(&path)),
            None => Self::base(),
        }
    }

    /// `deploy/kubernetes/base/` as written (the ConfigMap is generated
    /// from `idemproxy.toml` there).
    fn base() -> Manifests {
        let dir = root().join("deploy/kubernetes/base");
        let mut objects = BTreeMap::new();
        let mut files: Vec<_> = std::fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().path())
            .filter(|p| p.extension().is_some_and(|x| x == "yaml"))
            .filter(|p| !p.ends_with("kustomization.yaml"))
            .collect();
        files.sort();
        for file in files {
            for doc in documents(&read(&file), &file.display().to_string()) {
                objects.insert(object_id(&doc), doc);
            }
        }
        Manifests {
            objects,
            toml: read(&dir.join("idemproxy.toml")),
            origin: dir.display().to_string(),
        }
    }

    /// A kustomize rendering: one stream with the ConfigMap inline.
    fn rendered(path: &Path) -> Manifests {
        let mut objects = BTreeMap::new();
        for doc in documents(&read(path), &path.display().to_string()) {
            objects.insert(object_id(&doc), doc);
        }
        let configmap = objects
            .iter()
            .find(|(id, _)| id.starts_with("ConfigMap/idemproxy-config"))
            .map(|(_, v)| v)
            .expect("a ConfigMap named idemproxy-config*");
        let toml = str_at(configmap, "data.idemproxy\\.toml").to_owned();
        Manifests {
            objects,
            toml,
            origin: path.display().to_string(),
        }
    }

    fn get(&self, kind: &str, name: &str) -> &Value {
        self.objects
            .get(&format!("{kind}/{name}"))
            .unwrap_or_else(|| panic!("{}: no {kind} named {name}", self.origin))
    }

    fn of_kind(&self, kind: &str) -> impl Iterator<Item = &Value> {
        let prefix = format!("{kind}/");
        self.objects
            .iter()
            .filter(move |(id, _)| id.starts_with(&prefix))
            .map(|(_, v)| v)
    }

    fn config(&self) -> Config {
        config::parse(
            &self.toml,
            "idemproxy.toml (ConfigMap)",
            &Overrides::default(),
        )
        .unwrap_or_else(|e| panic!("the ConfigMap's TOML is not valid:\n{e}"))
    }
}

fn object_id(doc: &Value) -> String {
    format!("{}/{}", str_at(doc, "kind"), str_at(doc, "metadata.name"))
}

/// The value at a dotted path (`\.` for a literal dot in a key); list items
/// by index.
fn at<'a>(v: &'a Value, path: &str) -> Option<&'a Value> {
    let mut cur = v;
    let mut key = String::new();
    let mut keys = Vec::new();
    let mut chars = path.chars().peekable();
    while let Some(c) = chars.next() {
        match c {
            '\\' if chars.peek() == Some(&'.') => key.push(chars.next().unwrap_or('.')),
            '.' => keys.push(std::mem::take(&mut key)),
            c => key.push(c),
        }
    }
    keys.push(key);
    for k in keys {
        cur = match k.parse::<usize>() {
            Ok(i) if cur.is_sequence() => cur.get(i)?,
            _ => cur.get(k.as_str())?,
        };
    }
    Some(cur)
}

fn str_at<'a>(v: &'a Value, path: &str) -> &'a str {
    at(v, path)
        .and_then(Value::as_str)
        .unwrap_or_else(|| panic!("{path}: not a string in {v:?}"))
}

fn int_at(v: &Value, path: &str) -> i64 {
    at(v, path)
        .and_then(Value::as_i64)
        .unwrap_or_else(|| panic!("{path}: not an integer"))
}

fn list_at<'a>(v: &'a Value, path: &str) -> &'a [Value] {
    at(v, path)
        .and_then(Value::as_sequence)
        .map_or(&[], Vec::as_slice)
}

fn named<'a>(items: &'a [Value], name: &str) -> Option<&'a Value> {
    items
        .iter()
        .find(|c| c.get("name").and_then(Value::as_str) == Some(name))
}

fn deployment_pod(m: &Manifests) -> &Value {
    at(m.get("Deployment", "legacy-app"), "spec.template.spec").expect("a pod template")
}

fn sidecar(m: &Manifests) -> &Value {
    named(list_at(deployment_pod(m), "initContainers"), "idemproxy")
        .expect("idemproxy among the Deployment's initContainers")
}

fn http_probe(container: &Value, probe: &str) -> (String, i64) {
    let get = at(container, &format!("{probe}.httpGet"))
        .unwrap_or_else(|| panic!("{probe}: an httpGet probe"));
    (str_at(get, "path").to_owned(), int_at(get, "port"))
}

fn duration_secs(d: Duration) -> i64 {
    i64::try_from(d.as_secs()).unwrap() + i64::from(d.subsec_nanos() > 0)
}

/// The arguments after `--config`.
fn config_flag(args: &[Value]) -> Option<&str> {
    let args: Vec<&str> = args.iter().filter_map(Value::as_str).collect();
    let i = args.iter().position(|a| *a == "--config")?;
    args.get(i + 1).copied()
}

// ---------------------------------------------------------------------------
// Kubernetes

#[test]
fn idemproxy_is_a_native_sidecar_of_the_app() {
    let m = Manifests::load();
    let pod = deployment_pod(&m);
    let proxy = sidecar(&m);
    assert_eq!(str_at(proxy, "restartPolicy"), "Always", "a native sidecar");
    assert!(
        named(list_at(pod, "containers"), "idemproxy").is_none(),
        "idemproxy must not also be a regular container"
    );
    let args = list_at(proxy, "args");
    assert_eq!(args.first().and_then(Value::as_str), Some("serve"));
    assert!(
        !list_at(pod, "containers").is_empty(),
        "the app is a regular container"
    );
}

#[test]
fn sidecar_probes_use_the_admin_endpoints_on_the_admin_port() {
    let m = Manifests::load();
    let config = m.config();
    let admin = i64::from(config.server.admin_listen.port());
    let proxy = sidecar(&m);
    assert_eq!(http_probe(proxy, "startupProbe"), ("/readyz".into(), admin));
    assert_eq!(
        http_probe(proxy, "readinessProbe"),
        ("/readyz".into(), admin)
    );
    assert_eq!(
        http_probe(proxy, "livenessProbe"),
        ("/healthz".into(), admin)
    );
    // The kubelet probes over the pod IP, never the pod's loopback.
    assert!(
        config.server.admin_listen.ip().is_unspecified(),
        "admin_listen must bind every address inside the pod, not {}",
        config.server.admin_listen
    );
    let ports: Vec<i64> = list_at(proxy, "ports")
        .iter()
        .map(|p| int_at(p, "containerPort"))
        .collect();
    assert!(ports.contains(&admin), "{ports:?} lacks the admin port");
}

#[test]
fn service_targets_the_proxy_port_not_the_app() {
    let m = Manifests::load();
    let config = m.config();
    let proxy_port = i64::from(config.server.listen.port());
    let app_port = i64::from(config.upstream.url.port_u16().unwrap_or(80));
    let pod_labels = at(
        m.get("Deployment", "legacy-app"),
        "spec.template.metadata.labels",
    )
    .and_then(Value::as_mapping)
    .expect("pod labels");
    // Every Service but the example overlay's own PostgreSQL.
    let services = m
        .of_kind("Service")
        .filter(|s| str_at(s, "metadata.name") != "postgres");
    for service in services {
        let selector = at(service, "spec.selector")
            .and_then(Value::as_mapping)
            .expect("a selector");
        assert!(
            selector.iter().all(|(k, v)| pod_labels.get(k) == Some(v)),
            "the Service selects the app's pods"
        );
        for port in list_at(service, "spec.ports") {
            // A number: named ports of native sidecars resolve only on 1.32+.
            let target = int_at(port, "targetPort");
            assert_eq!(target, proxy_port, "the Service must target the proxy");
            assert_ne!(target, app_port);
        }
    }
    let ports: Vec<i64> = list_at(sidecar(&m), "ports")
        .iter()
        .map(|p| int_at(p, "containerPort"))
        .collect();
    assert!(ports.contains(&proxy_port));
    assert!(
        config.upstream.url.host() == Some("127.0.0.1"),
        "the app is reached on the pod's loopback, not {}",
        config.upstream.url
    );
}

#[test]
fn database_url_comes_from_a_secret() {
    let m = Manifests::load();
    let job = m.get("Job", "idemproxy-migrate");
    let job_container = &list_at(job, "spec.template.spec.containers")[0];
    for container in [sidecar(&m), job_container] {
        let env = named(list_at(container, "env"), "IDEMPROXY_DATABASE_URL")
            .expect("IDEMPROXY_DATABASE_URL in the environment");
        assert!(env.get("value").is_none(), "never a literal URL");
        let reference = at(env, "valueFrom.secretKeyRef").expect("a secretKeyRef");
        assert!(str_at(reference, "name").starts_with("idemproxy-database"));
        assert_eq!(str_at(reference, "key"), "url");
    }
    assert!(
        !m.toml.contains("database_url"),
        "the ConfigMap must not carry the database URL"
    );
}

#[test]
fn every_container_runs_hardened_and_non_root() {
    let m = Manifests::load();
    let pods = [
        deployment_pod(&m),
        at(m.get("Job", "idemproxy-migrate"), "spec.template.spec").unwrap(),
    ];
    for pod in pods {
        assert_eq!(
            at(pod, "automountServiceAccountToken").and_then(Value::as_bool),
            Some(false)
        );
        let pod_sc = at(pod, "securityContext");
        let containers = list_at(pod, "initContainers")
            .iter()
            .chain(list_at(pod, "containers"));
        for c in containers {
            let name = str_at(c, "name");
            let sc = at(c, "securityContext").unwrap_or_else(|| panic!("{name}: securityContext"));
            // A container setting wins over the pod's.
            let setting = |key: &str| sc.get(key).or_else(|| pod_sc.and_then(|p| p.get(key)));
            assert_eq!(
                setting("runAsNonRoot").and_then(Value::as_bool),
                Some(true),
                "{name}"
            );
            let uid = setting("runAsUser").and_then(Value::as_i64);
            assert!(uid.is_some_and(|u| u > 0), "{name}: numeric non-root user");
            assert_eq!(
                sc.get("readOnlyRootFilesystem").and_then(Value::as_bool),
                Some(true),
                "{name}"
            );
            assert_eq!(
                sc.get("allowPrivilegeEscalation").and_then(Value::as_bool),
                Some(false),
                "{name}"
            );
            let drop: Vec<&str> = list_at(sc, "capabilities.drop")
                .iter()
                .filter_map(Value::as_str)
                .collect();
            assert_eq!(drop, ["ALL"], "{name}");
            assert_eq!(
                setting("seccompProfile")
                    .and_then(|p| p.get("type"))
                    .and_then(Value::as_str),
                Some("RuntimeDefault"),
                "{name}"
            );
            assert!(
                at(c, "resources.requests.memory").is_some()
                    && at(c, "resources.limits.memory").is_some(),
                "{name}: memory request and limit"
            );
        }
    }
}

#[test]
fn termination_grace_covers_the_app_drain_and_shutdown_grace() {
    let m = Manifests::load();
    let config = m.config();
    let pod = deployment_pod(&m);
    let grace = int_at(pod, "terminationGracePeriodSeconds");
    let app_pre_stop: i64 = list_at(pod, "containers")
        .iter()
        .filter_map(|c| at(c, "lifecycle.preStop.sleep.seconds").and_then(Value::as_i64))
        .max()
        .unwrap_or(0);
    // Main containers stop first (preStop, then their drain, bounded by the
    // upstream timeout), then the sidecar drains within shutdown_grace.
    let needed = app_pre_stop
        + duration_secs(config.upstream.timeout)
        + duration_secs(config.server.shutdown_grace);
    assert!(
        grace > needed,
        "terminationGracePeriodSeconds {grace} must exceed {needed} \
         (preStop {app_pre_stop}s + upstream.timeout + shutdown_grace)"
    );
}

#[test]
fn config_is_mounted_where_the_commands_read_it() {
    let m = Manifests::load();
    let job = m.get("Job", "idemproxy-migrate");
    let job_pod = at(job, "spec.template.spec").unwrap();
    let job_container = &list_at(job_pod, "containers")[0];
    assert_eq!(
        list_at(job_container, "args")[0].as_str(),
        Some("migrate"),
        "the Job migrates"
    );
    for (pod, container) in [(deployment_pod(&m), sidecar(&m)), (job_pod, job_container)] {
        let path = config_flag(list_at(container, "args")).expect("--config FILE");
        let (dir, file) = path.rsplit_once('/').unwrap();
        let mount = list_at(container, "volumeMounts")
            .iter()
            .find(|v| str_at(v, "mountPath") == dir)
            .unwrap_or_else(|| panic!("nothing mounted at {dir}"));
        let volume = named(list_at(pod, "volumes"), str_at(mount, "name")).unwrap();
        assert!(str_at(volume, "configMap.name").starts_with("idemproxy-config"));
        assert_eq!(file, "idemproxy.toml", "the ConfigMap's key");
    }
}

#[test]
fn disruption_budget_selects_the_app() {
    let m = Manifests::load();
    let pdb = m.get("PodDisruptionBudget", "legacy-app");
    let pod_labels = at(
        m.get("Deployment", "legacy-app"),
        "spec.template.metadata.labels",
    )
    .and_then(Value::as_mapping)
    .unwrap();
    let selector = at(pdb, "spec.selector.matchLabels")
        .and_then(Value::as_mapping)
        .unwrap();
    assert!(selector.iter().all(|(k, v)| pod_labels.get(k) == Some(v)));
    assert!(at(pdb, "spec.maxUnavailable").is_some() || at(pdb, "spec.minAvailable").is_some());
}

// ---------------------------------------------------------------------------
// Compose

fn compose() -> Value {
    let path = root().join("deploy/compose/docker-compose.yml");
    documents(&read(&path), "docker-compose.yml").remove(0)
}

#[test]
fn compose_starts_idemproxy_after_healthy_dependencies() {
    let c = compose();
    assert!(
        c.get("name").is_none(),
        "no top-level name: the directory names the project"
    );
    let proxy = at(&c, "services.idemproxy").expect("an idemproxy service");
    for dep in ["postgres", "upstream"] {
        assert_eq!(
            str_at(proxy, &format!("depends_on.{dep}.condition")),
            "service_healthy",
            "{dep}"
        );
        assert!(at(&c, &format!("services.{dep}.healthcheck.test")).is_some());
    }
    let test: Vec<&str> = list_at(proxy, "healthcheck.test")
        .iter()
        .filter_map(Value::as_str)
        .collect();
    assert_eq!(test[..3], ["CMD", "/usr/local/bin/idemproxy", "health"]);
    // The admin port of config/compose.toml, probed and published; not
    // 9090, where a Prometheus beside it on the host listens.
    let config = config::load(&root().join("config/compose.toml"), &Overrides::default())
        .unwrap_or_else(|e| panic!("config/compose.toml:\n{e}"));
    let admin = config.server.admin_listen.port();
    assert_ne!(admin, 9090);
    assert!(
        test.last().unwrap().ends_with(&format!(":{admin}/readyz")),
        "{test:?}"
    );
    let published: Vec<&str> = list_at(proxy, "ports")
        .iter()
        .filter_map(Value::as_str)
        .collect();
    assert!(
        published.contains(&format!("127.0.0.1:{admin}:{admin}").as_str()),
        "{published:?}"
    );
}

#[test]
fn compose_mounts_a_valid_config_and_outlasts_its_drain() {
    let c = compose();
    let proxy = at(&c, "services.idemproxy").unwrap();
    let args = list_at(proxy, "command");
    let in_container = config_flag(args).expect("--config");
    let volume = list_at(proxy, "volumes")
        .iter()
        .filter_map(Value::as_str)
        .find(|v| v.split(':').nth(1) == Some(in_container))
        .expect("the config file is mounted");
    assert!(volume.ends_with(":ro"));
    let host = root()
        .join("deploy/compose")
        .join(volume.split(':').next().unwrap());
    let config = config::load(&host, &Overrides::default())
        .unwrap_or_else(|e| panic!("{}:\n{e}", host.display()));
    assert!(config.server.admin_listen.ip().is_unspecified());
    let stop = humantime::parse_duration(str_at(proxy, "stop_grace_period")).unwrap();
    assert!(
        stop > config.server.shutdown_grace,
        "stop_grace_period {stop:?} must exceed shutdown_grace"
    );
    assert!(
        str_at(proxy, "environment.IDEMPROXY_DATABASE_URL").starts_with("postgres://"),
        "the database URL comes from the environment"
    );
    assert_eq!(at(proxy, "read_only").and_then(Value::as_bool), Some(true));
}

// ---------------------------------------------------------------------------
// Image and configs

#[test]
fn image_is_static_scratch_non_root_and_exposes_both_ports() {
    let dockerfile = read(&root().join("Dockerfile"));
    let lines: Vec<&str> = dockerfile
        .lines()
        .map(str::trim)
        .filter(|l| !l.starts_with('#') && !l.is_empty())
        .collect();
    let last_from = lines.iter().rposition(|l| l.starts_with("FROM ")).unwrap();
    let runtime = &lines[last_from..];
    assert_eq!(runtime[0], "FROM scratch", "the runtime stage has no OS");
    let user = runtime
        .iter()
        .find_map(|l| l.strip_prefix("USER "))
        .expect("a USER");
    let uid: u32 = user
        .split(':')
        .next()
        .unwrap()
        .parse()
        .expect("a numeric user");
    assert_ne!(uid, 0);
    assert!(runtime.contains(&"EXPOSE 8080 9090"));
    assert!(runtime.iter().any(|l| l.starts_with("ENTRYPOINT [\"/")));
    for target in ["x86_64-unknown-linux-musl", "aarch64-unknown-linux-musl"] {
        assert!(dockerfile.contains(target), "a static build for {target}");
    }
    assert!(
        dockerfile.contains("FROM --platform=$BUILDPLATFORM ")
            && dockerfile.contains("ARG TARGETARCH"),
        "the builder cross-compiles on the build machine for TARGETARCH"
    );
    for label in ["source", "documentation", "version", "revision"] {
        assert!(
            dockerfile.contains(&format!("org.opencontainers.image.{label}=")),
            "OCI label {label}"
        );
    }
    assert!(dockerfile.contains("FROM ${BINARY_SOURCE} AS binaries"));
}

#[test]
fn shipped_config_files_are_valid() {
    for file in [
        "config/compose.toml",
        "deploy/kubernetes/base/idemproxy.toml",
    ] {
        let path = root().join(file);
        if let Err(e) = config::load(&path, &Overrides::default()) {
            panic!("{file}:\n{e}");
        }
    }
}

// ---------------------------------------------------------------------------
// Grafana

#[test]
fn grafana_dashboard_queries_only_metrics_the_proxy_exposes() {
    use idemproxy::metrics::{Metrics, Outcome};
    let path = root().join("deploy/grafana/idemproxy-dashboard.json");
    let dashboard: serde_json::Value = serde_json::from_str(&read(&path)).unwrap();
    let m = Metrics::new();
    // Give every family a series so that it is rendered.
    m.request("all", Outcome::Replayed, 200, Duration::from_millis(3));
    m.upstream(Duration::from_millis(3));
    m.store("claim", Duration::from_millis(1));
    m.renewal("ok");
    m.takeover();
    m.takeover_declined();
    m.swept(1);
    m.pool(1, 1, 0);
    m.worker_connections(&[1, 0]);
    let exposed = m.render();
    let mut queried = Vec::new();
    for panel in dashboard["panels"].as_array().unwrap() {
        for target in panel["targets"].as_array().into_iter().flatten() {
            let expr = target["expr"].as_str().unwrap();
            let mut rest = expr;
            while let Some(i) = rest.find("idemproxy_") {
                let name: String = rest[i..]
                    .chars()
                    .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                    .collect();
                rest = &rest[i + name.len()..];
                queried.push(name);
            }
        }
    }
    assert!(
        queried.len() > 10,
        "the dashboard queries idemproxy metrics"
    );
    for name in queried {
        assert!(
            exposed
                .lines()
                .any(|l| l.starts_with(&format!("{name} ")) || l.starts_with(&format!("{name}{{"))),
            "the dashboard queries {name}, which /metrics does not expose"
        );
    }
}

// ---------------------------------------------------------------------------
// Adoption: the sidecar component on a Deployment it did not write

/// The component's objects: rendered onto `deploy/kubernetes/examples/adopt`
/// when CI passes `IDEMPROXY_RENDERED_ADOPTION=<rendered.yaml>` (kustomize
/// applied the patches to the foreign Deployment and Service), else its
/// sources as written (the patch and the NetworkPolicy).
struct Adoption {
    /// The pod spec the sidecar lives in.
    pod: Value,
    /// The pod template's labels.
    pod_labels: Value,
    /// The Service's first port's targetPort, after the component.
    target_port: i64,
    network_policy: Value,
    /// The app containers, as the foreign Deployment wrote them.
    apps: Vec<String>,
    toml: String,
}

fn adoption() -> Adoption {
    let dir = root().join("deploy/kubernetes/components/sidecar");
    match std::env::var_os("IDEMPROXY_RENDERED_ADOPTION") {
        Some(path) => {
            let m = Manifests::rendered(Path::new(&path));
            let deployment = m.get("Deployment", "orders");
            let service = m.get("Service", "orders");
            Adoption {
                pod: at(deployment, "spec.template.spec").unwrap().clone(),
                pod_labels: at(deployment, "spec.template.metadata.labels")
                    .unwrap()
                    .clone(),
                target_port: int_at(service, "spec.ports.0.targetPort"),
                network_policy: m.get("NetworkPolicy", "idemproxy-ingress").clone(),
                apps: list_at(deployment, "spec.template.spec.containers")
                    .iter()
                    .map(|c| str_at(c, "name").to_owned())
                    .collect(),
                toml: m.toml.clone(),
            }
        }
        None => {
            let patch = documents(&read(&dir.join("sidecar.yaml")), "sidecar.yaml").remove(0);
            let kustomization = read(&dir.join("kustomization.yaml"));
            // The Service patch, as the JSON patch writes it.
            let target_port = kustomization
                .split("path: /spec/ports/0/targetPort")
                .nth(1)
                .and_then(|rest| rest.split("value:").nth(1))
                .and_then(|v| v.lines().next())
                .and_then(|v| v.trim().parse().ok())
                .expect("the component replaces the Service's targetPort");
            Adoption {
                pod: at(&patch, "spec.template.spec").unwrap().clone(),
                pod_labels: at(&patch, "spec.template.metadata.labels").unwrap().clone(),
                target_port,
                network_policy: documents(
                    &read(&dir.join("networkpolicy.yaml")),
                    "networkpolicy.yaml",
                )
                .remove(0),
                apps: vec![],
                toml: read(&dir.join("idemproxy.toml")),
            }
        }
    }
}

#[test]
fn the_component_adds_a_native_sidecar_with_a_startup_probe() {
    let a = adoption();
    let sidecar = named(list_at(&a.pod, "initContainers"), "idemproxy")
        .expect("idemproxy among the initContainers");
    assert_eq!(
        str_at(sidecar, "restartPolicy"),
        "Always",
        "a native sidecar"
    );
    let config: Config = config::parse(&a.toml, "component idemproxy.toml", &Overrides::default())
        .unwrap_or_else(|e| panic!("the component's TOML:\n{e}"));
    let admin = i64::from(config.server.admin_listen.port());
    assert_eq!(
        http_probe(sidecar, "startupProbe"),
        ("/readyz".into(), admin)
    );
    assert_eq!(
        http_probe(sidecar, "livenessProbe"),
        ("/healthz".into(), admin)
    );
    assert_eq!(
        at(&a.pod_labels, "idemproxy/inject").and_then(Value::as_str),
        Some("true")
    );
    // The app containers stay as they were, beside it.
    assert!(
        a.apps.iter().all(|c| c != "idemproxy"),
        "the sidecar is not a regular container: {:?}",
        a.apps
    );
    if std::env::var_os("IDEMPROXY_RENDERED_ADOPTION").is_some() {
        assert_eq!(a.apps, ["orders"], "the foreign app is kept");
    }
}

#[test]
fn the_component_moves_the_service_to_the_proxy_and_fences_the_app() {
    let a = adoption();
    let config: Config = config::parse(&a.toml, "component idemproxy.toml", &Overrides::default())
        .unwrap_or_else(|e| panic!("the component's TOML:\n{e}"));
    let proxy = i64::from(config.server.listen.port());
    let admin = i64::from(config.server.admin_listen.port());
    assert_eq!(
        a.target_port, proxy,
        "the Service sends clients to the proxy"
    );
    let np = &a.network_policy;
    assert_eq!(
        at(np, "spec.podSelector.matchLabels.idemproxy/inject").and_then(Value::as_str),
        Some("true")
    );
    assert_eq!(list_at(np, "spec.policyTypes"), [Value::from("Ingress")]);
    let rules = list_at(np, "spec.ingress");
    let ports = |rule: &Value| -> Vec<i64> {
        list_at(rule, "ports")
            .iter()
            .map(|p| int_at(p, "port"))
            .collect()
    };
    // Anyone may reach the proxy's port; only monitoring the admin port;
    // nothing else is open (the app's port above all).
    let open: Vec<&Value> = rules.iter().filter(|r| r.get("from").is_none()).collect();
    assert_eq!(open.len(), 1);
    assert_eq!(ports(open[0]), [proxy]);
    let restricted: Vec<&Value> = rules.iter().filter(|r| r.get("from").is_some()).collect();
    assert_eq!(restricted.len(), 1);
    assert_eq!(ports(restricted[0]), [admin]);
    assert!(
        at(restricted[0], "from.0.namespaceSelector").is_some(),
        "the admin port admits one namespace"
    );
    let app_port = config.upstream.url.port_u16().map(i64::from);
    assert!(
        app_port.is_some_and(|p| p != proxy && p != admin),
        "the app's port is not admitted"
    );
    assert!(
        config.upstream.url.host() == Some("127.0.0.1"),
        "the proxy reaches the app over the pod's loopback"
    );
}

// ---------------------------------------------------------------------------
// Monitoring: the PrometheusRule says what docs/operations.md says

/// `(alert, expression, for, severity)` rows of docs/operations.md's
/// "Alerts" table.
fn documented_alerts() -> Vec<(String, String, String, String)> {
    let doc = read(&root().join("docs/operations.md"));
    let section = doc
        .split("### Alerts")
        .nth(1)
        .and_then(|s| s.split("\n## ").next())
        .expect("docs/operations.md has an Alerts section");
    section
        .lines()
        .filter(|l| l.starts_with("| `Idemproxy"))
        .map(|l| {
            let cells: Vec<String> = l
                .trim_matches('|')
                .split(" | ")
                .map(|c| c.trim().trim_matches('`').to_owned())
                .collect();
            (
                cells[0].clone(),
                cells[1].clone(),
                cells[2].clone(),
                cells[3].clone(),
            )
        })
        .collect()
}

#[test]
fn the_prometheus_rule_carries_the_documented_alerts() {
    let path = root().join("deploy/kubernetes/components/monitoring/prometheusrule.yaml");
    let rule = documents(&read(&path), "prometheusrule.yaml").remove(0);
    let squash = |s: &str| s.split_whitespace().collect::<Vec<_>>().join(" ");
    let mut shipped = Vec::new();
    for group in list_at(&rule, "spec.groups") {
        for r in list_at(group, "rules") {
            shipped.push((
                str_at(r, "alert").to_owned(),
                squash(str_at(r, "expr")),
                str_at(r, "for").to_owned(),
                str_at(r, "labels.severity").to_owned(),
            ));
        }
    }
    let documented: Vec<_> = documented_alerts()
        .into_iter()
        .map(|(a, e, f, s)| (a, squash(&e), f, s))
        .collect();
    assert!(documented.len() >= 5, "{documented:?}");
    assert_eq!(shipped, documented);
    // Every series an alert reads is one the proxy exposes (documented in
    // the metrics table, which a unit test keeps in step with /metrics).
    let doc = read(&root().join("docs/operations.md"));
    for (alert, expr, ..) in &shipped {
        let mut rest = expr.as_str();
        while let Some(i) = rest.find("idemproxy_") {
            let name: String = rest[i..]
                .chars()
                .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                .collect();
            rest = &rest[i + name.len()..];
            let family = name.trim_end_matches("_bucket");
            assert!(
                doc.contains(&format!("| `{family}` |")),
                "{alert} reads {name}, not in the metrics table"
            );
        }
    }
}

#[test]
fn the_pod_monitor_scrapes_the_injected_pods_admin_port() {
    let dir = root().join("deploy/kubernetes/components");
    let pm = documents(
        &read(&dir.join("monitoring/podmonitor.yaml")),
        "podmonitor.yaml",
    )
    .remove(0);
    assert_eq!(
        at(&pm, "spec.selector.matchLabels.idemproxy/inject").and_then(Value::as_str),
        Some("true")
    );
    let endpoint = &list_at(&pm, "spec.podMetricsEndpoints")[0];
    assert_eq!(str_at(endpoint, "path"), "/metrics");
    let patch = documents(&read(&dir.join("sidecar/sidecar.yaml")), "sidecar.yaml").remove(0);
    let sidecar = named(
        list_at(&patch, "spec.template.spec.initContainers"),
        "idemproxy",
    )
    .unwrap();
    let port = named(list_at(sidecar, "ports"), str_at(endpoint, "port"))
        .expect("the PodMonitor names a port of the sidecar");
    assert_eq!(int_at(port, "containerPort"), 9090);
}
