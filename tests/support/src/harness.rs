//! Test harness: a real `blockplane serve` process on a temp data dir, an HTTP
//! client that checks every answer against the committed OpenAPI document, and
//! helpers to look at the kernel's loop devices.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use blockplane_client::{Answer, Endpoint, Transport};
use hyper::{Method, StatusCode};
use serde_json::{Value, json};

/// The binary under test: `blockplane` beside the test executable's
/// `deps/` directory, where cargo builds it for the `blockplane` crate's
/// test targets (`CARGO_BIN_EXE_blockplane`, which only those targets see).
/// The VM suite bind-mounts both at the same paths in the guest.
pub fn bin() -> &'static str {
    static BIN: OnceLock<String> = OnceLock::new();
    BIN.get_or_init(|| {
        let exe = std::env::current_exe().expect("the test executable's path");
        let bin = exe
            .parent()
            .and_then(Path::parent)
            .expect("a test executable in target/<profile>/deps")
            .join("blockplane");
        assert!(
            bin.exists(),
            "{}: no blockplane binary beside the tests (build it with cargo test)",
            bin.display()
        );
        bin.to_str().expect("a UTF-8 path").to_string()
    })
}

/// The repository's top (this crate is `tests/support`).
pub fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// The committed OpenAPI document.
pub fn openapi_path() -> PathBuf {
    repo().join("openapi/openapi.json")
}

fn openapi() -> &'static Value {
    static DOC: OnceLock<Value> = OnceLock::new();
    DOC.get_or_init(|| {
        let text = std::fs::read_to_string(openapi_path()).expect("read openapi/openapi.json");
        let mut doc: Value = serde_json::from_str(&text).expect("openapi.json is JSON");
        // Answers must not carry fields the document does not name.
        if let Some(schemas) = doc["components"]["schemas"].as_object_mut() {
            for s in schemas.values_mut() {
                if s.get("properties").is_some() && s.get("additionalProperties").is_none() {
                    s["additionalProperties"] = json!(false);
                }
            }
        }
        doc
    })
}

/// Checks one answer against the document: the status must be documented for
/// the operation, and the body must match its schema (or be empty).
pub fn check_against_openapi(method: &Method, path: &str, a: &Answer) {
    let doc = openapi();
    let path_only = path.split('?').next().unwrap();
    if path_only == "/openapi.json" {
        return;
    }
    let Some((template, item)) = doc["paths"]
        .as_object()
        .unwrap()
        .iter()
        .find(|(t, _)| template_matches(t, path_only))
    else {
        // Only the API's own JSON 404 may come back for an undocumented path.
        assert!(
            matches!(a.status.as_u16(), 404 | 401),
            "{method} {path}: not in openapi.json, answered {}",
            a.status
        );
        validate(
            &json!({"$ref": "#/components/schemas/ErrorBody"}),
            &a.body,
            method,
            path,
        );
        return;
    };
    let op = &item[method.as_str().to_ascii_lowercase()];
    if op.is_null() {
        // Only the API's own 405 answer may come back for an undocumented method.
        assert_eq!(
            a.status,
            StatusCode::METHOD_NOT_ALLOWED,
            "{method} {template}"
        );
        validate(
            &json!({"$ref": "#/components/schemas/ErrorBody"}),
            &a.body,
            method,
            path,
        );
        return;
    }
    let status = a.status.as_u16().to_string();
    let resp = &op["responses"][&status];
    if resp.is_null() {
        // 401 applies to every operation through the security scheme.
        if a.status == StatusCode::UNAUTHORIZED {
            validate(
                &json!({"$ref": "#/components/schemas/ErrorBody"}),
                &a.body,
                method,
                path,
            );
            return;
        }
        panic!(
            "{method} {path} answered {status}, which openapi.json does not document for {template}: {}",
            a.body
        );
    }
    match resp["content"]["application/json"]["schema"].clone() {
        Value::Null => assert!(
            a.body.is_null(),
            "{method} {path}: {status} should have no body: {}",
            a.body
        ),
        schema => validate(&schema, &a.body, method, path),
    }
}

fn validate(schema: &Value, body: &Value, method: &Method, path: &str) {
    let doc = openapi();
    let mut full = schema.clone();
    full["$schema"] = json!("https://json-schema.org/draft/2020-12/schema");
    full["components"] = doc["components"].clone();
    let v = jsonschema::validator_for(&full).expect("schema compiles");
    let errors: Vec<String> = v
        .iter_errors(body)
        .map(|e| format!("{} at {}", e, e.instance_path))
        .collect();
    assert!(
        errors.is_empty(),
        "{method} {path}: body does not match openapi.json: {errors:?}\nbody: {body}"
    );
}

fn template_matches(template: &str, path: &str) -> bool {
    let t: Vec<&str> = template.split('/').collect();
    let p: Vec<&str> = path.split('/').collect();
    t.len() == p.len()
        && t.iter()
            .zip(&p)
            .all(|(t, p)| (t.starts_with('{') && !p.is_empty()) || t == p)
}

/// `serve` arguments giving new key slots argon2id's least fixed cost: for
/// tests whose subject is not the key's cost, since a timed cost has
/// cryptsetup benchmark argon2id before every new key, seconds each under an
/// emulator.
pub const CHEAP_KEYS: [&str; 4] = ["--key-kdf-iterations", "4", "--key-kdf-memory-kib", "32"];

/// Options for starting the service.
#[derive(Debug, Clone, Default)]
pub struct Opts {
    /// The bearer token the service requires on TCP (and the client sends).
    pub token: Option<String>,
    /// Also listen on this TCP address (`HOST:PORT`).
    pub tcp: Option<String>,
    /// More arguments of `blockplane serve`.
    pub extra_args: Vec<String>,
    /// More environment variables of the service's process.
    pub env: Vec<(String, String)>,
    /// More image roots (e.g. on the VM's scratch filesystems).
    pub extra_roots: Vec<PathBuf>,
    /// The executable to run the service from (default: [`bin()`]), e.g. a
    /// copy that a test replaces as a package upgrade does.
    pub bin: Option<PathBuf>,
    /// The soft limit on open files the service starts with (the hard one
    /// stays the test's), as a shell or a service manager may give it.
    pub open_files: Option<u64>,
    /// The network namespace (`/run/netns/<name>`, as `ip netns add` makes
    /// it) the service runs in: one "host" of a test with two. Only the
    /// network is entered (`nsenter --net`), so the service sees the
    /// host's sysfs, configfs and devices as any service would.
    pub netns: Option<String>,
}

/// A running `blockplane serve` on its own temp dirs.
pub struct Service {
    /// The temp dir holding the rest (removed when dropped).
    pub dir: tempfile::TempDir,
    /// The service's data dir (registry, run dirs).
    pub data: PathBuf,
    /// Its image root.
    pub images: PathBuf,
    /// The API's unix socket.
    pub sock: PathBuf,
    /// What it was started with.
    pub opts: Opts,
    child: Option<Child>,
    log: PathBuf,
}

impl Service {
    /// Starts a service with default options.
    pub async fn start() -> Self {
        Self::start_with(Opts::default()).await
    }

    /// Starts a service and waits until it answers.
    pub async fn start_with(opts: Opts) -> Self {
        Self::start_prepared(opts, |_| {}).await
    }

    /// Starts a service after `prepare` has run with its data dir's path (not
    /// made yet): to mount a filesystem there or to seed it.
    pub async fn start_prepared(opts: Opts, prepare: impl FnOnce(&Path)) -> Self {
        let dir = tempfile::Builder::new()
            .prefix("bp")
            .tempdir_in("/tmp")
            .unwrap();
        let data = dir.path().join("data");
        let images = dir.path().join("images");
        std::fs::create_dir_all(&images).unwrap();
        let sock = data.join("blockplane.sock");
        let log = dir.path().join("service.log");
        let mut s = Self {
            dir,
            data,
            images,
            sock,
            opts,
            child: None,
            log,
        };
        prepare(&s.data);
        s.spawn(&[]);
        s.wait_ready().await;
        s
    }

    /// The command line the service is started with.
    pub fn command(&self) -> Command {
        let program = self.opts.bin.as_deref().unwrap_or(Path::new(bin()));
        let mut c = match &self.opts.netns {
            Some(ns) => {
                let mut c = Command::new("nsenter");
                c.arg(format!("--net=/run/netns/{ns}"))
                    .arg("--")
                    .arg(program);
                c
            }
            None => Command::new(program),
        };
        c.arg("serve")
            .arg("--data-dir")
            .arg(&self.data)
            .arg("--image-root")
            .arg(&self.images)
            .arg("--listen")
            .arg(format!("unix:{}", self.sock.display()))
            .args(&self.opts.extra_args)
            .env_remove("BLOCKPLANE_TOKEN")
            .env("BLOCKPLANE_LOG", "info,blockplane=debug")
            .stdin(Stdio::null());
        if let Some(addr) = &self.opts.tcp {
            c.arg("--listen").arg(addr);
        }
        for root in &self.opts.extra_roots {
            c.arg("--image-root").arg(root);
        }
        if let Some(t) = &self.opts.token {
            c.env("BLOCKPLANE_TOKEN", t);
        }
        for (k, v) in &self.opts.env {
            c.env(k, v);
        }
        if let Some(soft) = self.opts.open_files {
            use rustix::process::{Resource, Rlimit, getrlimit, setrlimit};
            use std::os::unix::process::CommandExt;
            let hard = getrlimit(Resource::Nofile).maximum;
            let limit = Rlimit {
                current: Some(soft),
                maximum: hard,
            };
            // SAFETY: only setrlimit, which allocates nothing, between fork
            // and exec.
            unsafe {
                c.pre_exec(move || setrlimit(Resource::Nofile, limit).map_err(Into::into));
            }
        }
        c
    }

    /// Starts the process (again), with extra env for this start only.
    pub fn spawn(&mut self, env: &[(&str, &str)]) {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log)
            .unwrap();
        let mut c = self.command();
        for (k, v) in env {
            c.env(k, v);
        }
        c.stdout(log.try_clone().unwrap()).stderr(log);
        self.child = Some(c.spawn().expect("start blockplane"));
    }

    /// Waits until `/healthz` answers, then until the start has reconciled
    /// every volume (volumes, then orphan devices): what a test that restarts the
    /// service and looks at its volumes means by ready. Panics with the log
    /// after 180 s: a start that recovers devices on a loaded emulator
    /// takes tens of seconds (the three ublk devices of a killed pod took
    /// 105 s on 6.12 before volumes recovered side by side).
    pub async fn wait_ready(&mut self) {
        let deadline = Instant::now() + Duration::from_secs(180);
        self.wait_answers_until(deadline).await;
        loop {
            let host = self.get("/v1/host").await;
            // A build before `reconciled` reconciled before it answered.
            if host.status != StatusCode::OK || host.body["reconciled"] != false {
                return;
            }
            self.still_starting(deadline);
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Waits until `/healthz` answers, reconciled or not.
    pub async fn wait_answers(&mut self) {
        self.wait_answers_until(Instant::now() + Duration::from_secs(180))
            .await;
    }

    async fn wait_answers_until(&mut self, deadline: Instant) {
        loop {
            if let Ok(a) = self.raw_client().send(Method::GET, "/healthz", None).await
                && a.status == StatusCode::OK
            {
                return;
            }
            self.still_starting(deadline);
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Panics with the log if the service exited or `deadline` passed.
    fn still_starting(&mut self, deadline: Instant) {
        if let Some(status) = self.child.as_mut().and_then(|c| c.try_wait().unwrap()) {
            panic!(
                "blockplane exited with {status} before it was ready:\n{}",
                self.log_text()
            );
        }
        assert!(
            Instant::now() < deadline,
            "blockplane was not ready in 180 s:\n{}",
            self.log_text()
        );
    }

    /// The running service's process id.
    pub fn pid(&self) -> u32 {
        self.child.as_ref().expect("the service runs").id()
    }

    /// Shuts the copy gate: while the returned file exists, a file copy the
    /// test fault `slow_copy` slows waits after its current stretch (a
    /// cancel still ends it). Remove the file to let copies go on.
    pub fn shut_copy_gate(&self) -> PathBuf {
        let gate = self.data.join("run/copy-gate");
        std::fs::create_dir_all(gate.parent().unwrap()).unwrap();
        std::fs::write(&gate, b"").unwrap();
        gate
    }

    /// The service's log so far.
    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    fn raw_client(&self) -> Transport {
        Transport::new(Endpoint::Unix(self.sock.clone()), self.opts.token.clone())
    }

    /// Sends a request, checks the answer against openapi.json, returns it.
    pub async fn call(&self, method: Method, path: &str, body: Option<Value>) -> Answer {
        let a = self
            .raw_client()
            .send(method.clone(), path, body.as_ref())
            .await
            .unwrap_or_else(|e| panic!("{method} {path}: {e}\n{}", self.log_text()));
        check_against_openapi(&method, path, &a);
        a
    }

    /// GETs a text answer (e.g. `/metrics`); panics unless 200.
    pub async fn get_text(&self, path: &str) -> String {
        let (status, text) = self
            .raw_client()
            .send_raw(Method::GET, path, None)
            .await
            .unwrap_or_else(|e| panic!("GET {path}: {e}\n{}", self.log_text()));
        assert_eq!(status, StatusCode::OK, "GET {path}: {text}");
        text
    }

    /// `GET path`, checked against the OpenAPI document.
    pub async fn get(&self, path: &str) -> Answer {
        self.call(Method::GET, path, None).await
    }

    /// `POST path` with a JSON body, checked.
    pub async fn post(&self, path: &str, body: Value) -> Answer {
        self.call(Method::POST, path, Some(body)).await
    }

    /// `PUT path` with a JSON body, checked.
    pub async fn put(&self, path: &str, body: Value) -> Answer {
        self.call(Method::PUT, path, Some(body)).await
    }

    /// `PATCH path` with a JSON body, checked.
    pub async fn patch(&self, path: &str, body: Value) -> Answer {
        self.call(Method::PATCH, path, Some(body)).await
    }

    /// `DELETE path`, checked.
    pub async fn delete(&self, path: &str) -> Answer {
        self.call(Method::DELETE, path, None).await
    }

    /// A DELETE with a JSON body.
    pub async fn delete_with(&self, path: &str, body: Value) -> Answer {
        self.call(Method::DELETE, path, Some(body)).await
    }

    /// Sends the signal and waits for the process to end.
    pub fn signal(&mut self, sig: rustix::process::Signal) -> ExitStatus {
        let mut child = self.child.take().expect("service is running");
        let pid = rustix::process::Pid::from_child(&child);
        let _ = rustix::process::kill_process(pid, sig);
        child.wait().unwrap()
    }

    /// SIGKILL.
    pub fn kill(&mut self) {
        self.signal(rustix::process::Signal::KILL);
    }

    /// Waits for the process to end by itself (e.g. at a crash point).
    pub fn wait_exit(&mut self, within: Duration) -> ExitStatus {
        let deadline = Instant::now() + within;
        let child = self.child.as_mut().expect("service is running");
        loop {
            if let Some(st) = child.try_wait().unwrap() {
                self.child = None;
                return st;
            }
            assert!(
                Instant::now() < deadline,
                "service did not exit:\n{}",
                self.log_text()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Starts the service again on the same data dir.
    pub async fn restart(&mut self) {
        self.spawn(&[]);
        self.wait_ready().await;
    }

    /// Creates an image file of `size` bytes under the image root (mode 0600) and
    /// registers it; returns the image object.
    pub async fn image(&self, name: &str, size_mib: u64) -> Value {
        let path = self.images.join(format!("{name}.img"));
        let a = self
            .post(
                "/v1/images",
                json!({"name": name, "path": path, "create": {"size_bytes": size_mib << 20, "allocation": "full"}}),
            )
            .await;
        assert_eq!(a.status, StatusCode::CREATED, "{}", a.body);
        a.body
    }

    /// Creates a loop volume on a new image; returns the volume object.
    pub async fn loop_volume(&self, name: &str, size_mib: u64) -> Value {
        self.image(&format!("{name}-img"), size_mib).await;
        let a = self
            .post(
                "/v1/volumes",
                json!({"name": name, "image": format!("{name}-img"), "backend": "loop"}),
            )
            .await;
        assert_eq!(a.status, StatusCode::CREATED, "{}", a.body);
        a.body
    }

    /// Loop devices bound to files under this service's temp dir.
    pub fn my_loop_devices(&self) -> Vec<String> {
        loop_devices_under(self.dir.path())
    }
}

impl Drop for Service {
    fn drop(&mut self) {
        // Unless an owner already cleaned up (and printed them).
        if std::thread::panicking() && self.child.is_some() {
            self.print_logs();
        }
        self.stop_and_clean();
    }
}

impl Service {
    /// Deletes what the test left (volumes, through the service while it
    /// runs), stops the service and removes any device or worker left
    /// behind. Idempotent: a dropped service does it too.
    pub fn stop_and_clean(&mut self) {
        if self.child.is_some() {
            let cli = |args: &[&str]| {
                Command::new(bin())
                    .arg("--api")
                    .arg(format!("unix:{}", self.sock.display()))
                    .args(args)
                    .env_remove("BLOCKPLANE_TOKEN")
                    .envs(
                        self.opts
                            .token
                            .iter()
                            .map(|t| ("BLOCKPLANE_TOKEN", t.as_str())),
                    )
                    .output()
            };
            if let Ok(out) = cli(&["--json", "volume", "ls"])
                && let Ok(list) = serde_json::from_slice::<Value>(&out.stdout)
            {
                for v in list.as_array().into_iter().flatten() {
                    if let Some(id) = v["id"].as_str() {
                        let _ = cli(&["volume", "rm", id]);
                    }
                }
            }
        }
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
        // Leave no device behind, whatever the test did.
        for dev in loop_devices_under(self.dir.path()) {
            let _ = Command::new("losetup").arg("-d").arg(&dev).status();
        }
        kill_workers_of(&self.data);
    }
}

impl Service {
    /// Prints the service's log and its workers' logs (for a failing test).
    pub fn print_logs(&self) {
        let tail = |text: String| {
            let lines: Vec<&str> = text.lines().collect();
            lines[lines.len().saturating_sub(80)..].join("\n")
        };
        eprintln!("----- service log -----\n{}", tail(self.log_text()));
        if let Ok(dirs) = std::fs::read_dir(self.data.join("run/ublk")) {
            for d in dirs.flatten() {
                for f in ["worker.log", "worker.out"] {
                    if let Ok(t) = std::fs::read_to_string(d.path().join(f)) {
                        eprintln!("----- {} -----\n{}", d.path().join(f).display(), tail(t));
                    }
                }
            }
        }
    }
}

/// Kills ublk workers run from `data` (and deletes their devices): a test
/// that killed its service leaves them running.
pub fn kill_workers_of(data: &Path) {
    let run = data.join("run/ublk");
    let Ok(dirs) = std::fs::read_dir(&run) else {
        return;
    };
    for d in dirs.flatten() {
        let Ok(state) = std::fs::read(d.path().join("state.json")) else {
            continue;
        };
        let Ok(state) = serde_json::from_slice::<Value>(&state) else {
            continue;
        };
        if let Some(pid) = state["pid"].as_u64() {
            let _ = Command::new("kill").arg("-9").arg(pid.to_string()).status();
        }
        if let Some(id) = state["dev_id"].as_u64() {
            // Deleting a ublk device waits until nothing holds it open: a dm
            // volume's table (dispatch nowait/threaded) must go first.
            remove_dm_holders(&format!("ublkb{id}"));
            if let Ok(ctrl) = libublk::ctrl::UblkCtrl::new_simple(id as i32) {
                let _ = ctrl.kill_dev();
                let _ = ctrl.del_dev();
            }
        }
    }
}

/// Removes the blockplane dm devices stacked on block device `dev`.
fn remove_dm_holders(dev: &str) {
    let Ok(holders) = std::fs::read_dir(format!("/sys/block/{dev}/holders")) else {
        return;
    };
    for h in holders.flatten() {
        remove_blockplane_dm(&h.file_name().to_string_lossy());
    }
}

/// Removes the dm device `dm` (its kernel name, `dm-N`) if blockplane made
/// it (named `blockplane-*`), in use or not (`--force` fails what is in
/// flight); returns its dm name if it did.
pub fn remove_blockplane_dm(dm: &str) -> Option<String> {
    let name = std::fs::read_to_string(format!("/sys/block/{dm}/dm/name")).ok()?;
    let name = name.trim();
    if !name.starts_with("blockplane-") {
        return None;
    }
    let _ = Command::new("dmsetup")
        .args(["remove", "--force", name])
        .env("DM_DISABLE_UDEV", "1")
        .status();
    Some(name.to_string())
}

/// `(device, backing file)` of every bound loop device.
pub fn loop_devices() -> Vec<(String, String)> {
    let mut out = Vec::new();
    for e in std::fs::read_dir("/sys/block").unwrap().flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        if !name.starts_with("loop") {
            continue;
        }
        if let Ok(backing) = std::fs::read_to_string(e.path().join("loop/backing_file")) {
            out.push((format!("/dev/{name}"), backing.trim().to_string()));
        }
    }
    out
}

/// Loop devices whose backing file is under `dir`.
pub fn loop_devices_under(dir: &Path) -> Vec<String> {
    let dir = dir.display().to_string();
    loop_devices()
        .into_iter()
        .filter(|(_, f)| f.starts_with(&dir))
        .map(|(d, _)| d)
        .collect()
}

/// The backing file of a loop device, if bound.
pub fn backing_file(dev: &str) -> Option<String> {
    let name = dev.trim_start_matches("/dev/");
    std::fs::read_to_string(format!("/sys/block/{name}/loop/backing_file"))
        .ok()
        .map(|s| s.trim().to_string())
}

/// Whether `dev` is bound to a file under `dir` (another test may reuse a
/// freed loop device at once: asking only "is it bound" races).
pub fn serves_from(dev: &str, dir: &Path) -> bool {
    backing_file(dev).is_some_and(|f| f.starts_with(&dir.display().to_string()))
}

/// Size of a block device in bytes, from sysfs.
pub fn device_size(dev: &str) -> u64 {
    let name = dev.trim_start_matches("/dev/");
    std::fs::read_to_string(format!("/sys/block/{name}/size"))
        .unwrap()
        .trim()
        .parse::<u64>()
        .unwrap()
        * 512
}

/// Asserts an error answer: status, code, and that the message is not empty.
pub fn assert_error(a: &Answer, status: u16, code: &str) {
    assert_eq!(
        a.status.as_u16(),
        status,
        "expected {status} {code}, got {}",
        a.body
    );
    assert_eq!(a.body["error"]["code"], code, "{}", a.body);
    assert!(
        a.body["error"]["message"]
            .as_str()
            .is_some_and(|m| !m.is_empty()),
        "{}",
        a.body
    );
}

/// Everything a refusal must leave unchanged: images, volumes, every event,
/// this service's devices, every file under the image root and the data dir
/// (kind, mode, size, mtime and content), and every row of the registry.
#[derive(Debug, PartialEq)]
pub struct Snapshot {
    images: Value,
    volumes: Value,
    events: Value,
    devices: Vec<String>,
    files: Vec<String>,
    registry: Vec<String>,
}

/// The data dir's files whose bytes are SQLite's, not the registry's: the
/// WAL index is shared memory every connection writes on every read (read
/// marks and locks, this test's own reads included), so its bytes change
/// with no row changing. The registry is compared by its rows instead
/// ([`registry_rows`]); the database file and its WAL are compared by bytes
/// too, as SQLite writes them only on a commit.
const SQLITE_SCRATCH: &[&str] = &["blockplane.db-shm"];

impl Service {
    /// Records the state that refusals must not change.
    pub async fn snapshot(&self) -> Snapshot {
        let mut files = file_states(&self.images, &[]);
        files.extend(file_states(&self.data, SQLITE_SCRATCH));
        Snapshot {
            images: self.get("/v1/images").await.body,
            volumes: self.get("/v1/volumes").await.body,
            events: self.get("/v1/events?limit=1000").await.body,
            devices: self.my_loop_devices(),
            files,
            registry: registry_rows(&self.data.join("blockplane.db")).await,
        }
    }
}

fn walk(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    if let Ok(rd) = std::fs::read_dir(dir) {
        for e in rd.flatten() {
            let p = e.path();
            out.push(p.clone());
            // Not through symlinks: an attack's link may lead anywhere.
            if e.file_type().map(|t| t.is_dir()).unwrap_or(false) {
                out.extend(walk(&p));
            }
        }
    }
    out
}

/// One line per entry under `dir` (but the names in `skip`), sorted: its
/// kind, mode, owner and, for a regular file, size, mtime and a hash of its
/// bytes. A directory's mtime is left out: it moves with names added and
/// removed, which the list of entries shows. Only regular files are read
/// (never a device, FIFO or socket an attack put there).
fn file_states(dir: &Path, skip: &[&str]) -> Vec<String> {
    use std::hash::Hasher;
    use std::io::Read;
    use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
    let mut out: Vec<String> = walk(dir)
        .into_iter()
        .filter(|p| !p.file_name().is_some_and(|n| skip.iter().any(|s| n == *s)))
        .map(|p| {
            let Ok(m) = std::fs::symlink_metadata(&p) else {
                return format!("{} gone", p.display());
            };
            let t = m.file_type();
            let owner = format!("{:o} {}:{}", m.mode(), m.uid(), m.gid());
            if !t.is_file() {
                let kind = if t.is_dir() { "dir" } else { "other" };
                return format!("{} {kind} {owner} rdev {}", p.display(), m.rdev());
            }
            let mut h = std::hash::DefaultHasher::new();
            // Read with O_DIRECT where the filesystem has it: a direct-I/O
            // volume's image with cached pages is what the service warns
            // about (an event), and pages read buffered and dropped after
            // can be seen by its look in between.
            let direct = std::fs::OpenOptions::new()
                .read(true)
                .custom_flags(libc::O_DIRECT)
                .open(&p);
            let (file, buffered) = match direct {
                Ok(f) => (Ok(f), false),
                Err(_) => (std::fs::File::open(&p), true),
            };
            if let Ok(mut f) = file {
                // O_DIRECT wants an aligned buffer.
                let mut raw = vec![0u8; (1 << 20) + 4096];
                let skip = raw.as_ptr().align_offset(4096);
                let buf = &mut raw[skip..skip + (1 << 20)];
                // Only the data, where it is: a sparse image of tens of GiB
                // (sized by the host's free space) is read in no time, and
                // where its data lies is part of what it is.
                let mut at = 0;
                while let Ok(data) = rustix::fs::seek(&f, rustix::fs::SeekFrom::Data(at)) {
                    let end =
                        rustix::fs::seek(&f, rustix::fs::SeekFrom::Hole(data)).unwrap_or(m.len());
                    h.write_u64(data);
                    let mut left = end - data;
                    let _ = rustix::fs::seek(&f, rustix::fs::SeekFrom::Start(data));
                    while left > 0 {
                        match f.read(buf) {
                            Ok(0) | Err(_) => break,
                            Ok(n) => {
                                let n = n.min(left as usize);
                                h.write(&buf[..n]);
                                left -= n as u64;
                            }
                        }
                    }
                    at = end;
                }
                if buffered {
                    let _ = rustix::fs::fadvise(&f, 0, None, rustix::fs::Advice::DontNeed);
                }
            }
            format!(
                "{} file {owner} {} bytes mtime {}.{:09} content {:016x}",
                p.display(),
                m.len(),
                m.mtime(),
                m.mtime_nsec(),
                h.finish()
            )
        })
        .collect();
    out.sort();
    out
}

/// Every row of every table of the registry at `db`, one line each
/// (`table: values`, SQL-quoted), read through a read-only connection.
pub async fn registry_rows(db: &Path) -> Vec<String> {
    use sqlx::{Connection, Row};
    let mut c = sqlx::SqliteConnection::connect(&format!("sqlite://{}?mode=ro", db.display()))
        .await
        .unwrap_or_else(|e| panic!("open {} read-only: {e}", db.display()));
    let tables: Vec<String> =
        sqlx::query_scalar("SELECT name FROM sqlite_master WHERE type = 'table' ORDER BY name")
            .fetch_all(&mut c)
            .await
            .unwrap();
    let mut out = Vec::new();
    for t in tables {
        let columns: Vec<String> =
            sqlx::query_scalar("SELECT name FROM pragma_table_info(?) ORDER BY cid")
                .bind(&t)
                .fetch_all(&mut c)
                .await
                .unwrap();
        let values = columns
            .iter()
            .map(|col| format!("quote(\"{col}\")"))
            .collect::<Vec<_>>()
            .join(" || ', ' || ");
        // Names from the database's own schema, quoted: nothing from outside.
        let sql = sqlx::AssertSqlSafe(format!("SELECT {values} FROM \"{t}\" ORDER BY 1"));
        for row in sqlx::query(sql).fetch_all(&mut c).await.unwrap() {
            out.push(format!("{t}: {}", row.get::<String, _>(0)));
        }
    }
    c.close().await.unwrap();
    out
}

/// A filesystem made by `mkfs` (e.g. `["mkfs.ext4", "-q", "-F"]`) on a
/// sparse file of `size` bytes, mounted through a loop device on a private
/// (0700) directory: an image root with its own free space and features.
/// Unmounted when dropped.
pub struct LoopFs {
    /// Where it is mounted.
    pub mnt: PathBuf,
    _dir: tempfile::TempDir,
}

impl LoopFs {
    /// Makes, loop-mounts and opens it to the service's checks.
    pub fn new(mkfs: &[&str], size: u64) -> Self {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::Builder::new()
            .prefix("bpfs")
            .tempdir_in("/tmp")
            .unwrap();
        let fs_file = dir.path().join("fs.img");
        std::fs::File::create(&fs_file)
            .unwrap()
            .set_len(size)
            .unwrap();
        let made = Command::new(mkfs[0])
            .args(&mkfs[1..])
            .arg(&fs_file)
            .output()
            .unwrap();
        assert!(made.status.success(), "{mkfs:?}: {made:?}");
        let mnt = dir.path().join("mnt");
        std::fs::create_dir(&mnt).unwrap();
        let mounted = Command::new("mount")
            .args(["-o", "loop"])
            .arg(&fs_file)
            .arg(&mnt)
            .status()
            .unwrap();
        assert!(mounted.success());
        std::fs::set_permissions(&mnt, std::fs::Permissions::from_mode(0o700)).unwrap();
        Self { mnt, _dir: dir }
    }
}

impl Drop for LoopFs {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg("-l").arg(&self.mnt).status();
    }
}

/// A TCP port free on the loopback address now.
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// The bytes the kernel holds unread in each established connection a
/// listener on `port` accepted (its own side's receive queue, from
/// `/proc/net/tcp`): 0 once the service read all a client sent.
pub fn unread_on_accepted(port: u16) -> Vec<u64> {
    let text = std::fs::read_to_string("/proc/net/tcp").unwrap();
    text.lines()
        .skip(1)
        .filter_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            let local_port = u16::from_str_radix(f[1].rsplit(':').next()?, 16).ok()?;
            // 01: ESTABLISHED.
            (local_port == port && f[3] == "01").then(|| {
                let rx = f[4].split(':').nth(1).unwrap();
                u64::from_str_radix(rx, 16).unwrap()
            })
        })
        .collect()
}

/// Reads one HTTP/1.1 answer (head and `content-length` body) from `c`;
/// what arrived before the connection closed if it closed first.
pub async fn read_answer(c: &mut (impl tokio::io::AsyncRead + Unpin)) -> String {
    use tokio::io::AsyncReadExt;
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        if let Some(end) = got.windows(4).position(|w| w == b"\r\n\r\n") {
            let head = String::from_utf8_lossy(&got[..end]).to_ascii_lowercase();
            let len: usize = head
                .lines()
                .find_map(|l| l.strip_prefix("content-length:"))
                .and_then(|v| v.trim().parse().ok())
                .unwrap_or(0);
            if got.len() >= end + 4 + len {
                break;
            }
        }
        match c.read(&mut buf).await {
            Ok(0) | Err(_) => break,
            Ok(n) => got.extend_from_slice(&buf[..n]),
        }
    }
    String::from_utf8_lossy(&got).into_owned()
}
