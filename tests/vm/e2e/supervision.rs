//! The one supervisor of every ublk worker cannot fail silently: each way
//! it can fail (its start, its wait, a panic, a `pidfd_open` refused for
//! want of descriptors, a recovery thread that cannot start) is injected
//! while `<data dir>/run/supervisor-gate` exists. While it lasts, `GET
//! /v1/host`, `/metrics` and the volume say that the worker is not
//! supervised and why; once the gate is gone, a worker killed is recovered.
//!
//! Each test gathers what went wrong and fails once, at the end, listing it
//! all, so that a run on a build without the fix says every way it fails.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use serde_json::{Value, json};

use crate::{Scratch, Vm, direct_write, sh};

/// Polls `f` until it is true, up to `within`; whether it became true.
async fn became(within: Duration, mut f: impl AsyncFnMut() -> bool) -> bool {
    let deadline = Instant::now() + within;
    loop {
        if f().await {
            return true;
        }
        if Instant::now() > deadline {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// A service with supervisor fault `fault` armed and its gate in place, and
/// one ublk volume `s` on it.
struct Armed {
    vm: Vm,
    gate: PathBuf,
    volume: Value,
    /// What went wrong, said at the end.
    findings: Vec<String>,
}

impl Armed {
    async fn start(fault: &str) -> Self {
        let vm = Vm::start_with_env(&[("BLOCKPLANE_TEST_FAULT", fault)]).await;
        let gate = vm.s.data.join("run").join("supervisor-gate");
        std::fs::create_dir_all(gate.parent().unwrap()).unwrap();
        std::fs::write(&gate, b"").unwrap();
        Self::with_volume(vm, gate).await
    }

    async fn with_volume(vm: Vm, gate: PathBuf) -> Self {
        vm.image("s", Scratch::Xfs, 16, "full").await;
        let volume = vm
            .volume(json!({"name": "s", "image": "s", "backend": "ublk", "dispatch": "nowait"}))
            .await;
        Self {
            vm,
            gate,
            volume,
            findings: Vec::new(),
        }
    }

    fn pid(&self) -> u64 {
        self.volume["worker_pid"].as_u64().expect("a ublk worker")
    }

    async fn host(&self) -> Value {
        self.vm.s.get("/v1/host").await.body["supervision"].clone()
    }

    async fn now(&self) -> Value {
        self.vm.s.get("/v1/volumes/s").await.body
    }

    /// While the gate holds: the host says the supervisor does not run
    /// (`down`: for the faults that stop it), and the volume says its worker
    /// is not supervised, with a reason naming `why`.
    async fn says_why_while_gated(&mut self, down: bool, why: &str) {
        if down {
            let mut last = Value::Null;
            let said = became(Duration::from_secs(20), async || {
                last = self.host().await;
                last["state"] == "restarting" && last["reason"].as_str().is_some()
            })
            .await;
            if !said {
                self.findings.push(format!(
                    "while the fault held, GET /v1/host never said the supervisor is not running: supervision = {last}"
                ));
            }
            let text = self.vm.s.get_text("/metrics").await;
            if !text.contains("blockplane_worker_supervisor_running 0") {
                self.findings.push(format!(
                    "while the fault held, /metrics did not say blockplane_worker_supervisor_running 0: {:?}",
                    text.lines()
                        .filter(|l| l.contains("supervis"))
                        .collect::<Vec<_>>()
                ));
            }
        }
        let mut last = Value::Null;
        let said = became(Duration::from_secs(20), async || {
            last = self.now().await;
            last["worker_supervised"] == false
                && last["state"] == "degraded"
                && last["state_reason"]
                    .as_str()
                    .is_some_and(|r| r.contains("not supervised") && r.contains(why))
        })
        .await;
        if !said {
            self.findings.push(format!(
                "while the fault held, the volume never said that its worker is not supervised ({why}): state {}, state_reason {}, worker_supervised {}",
                last["state"], last["state_reason"], last["worker_supervised"]
            ));
        }
    }

    /// Removes the gate; the host then says the supervisor runs and the
    /// volume that its worker is supervised.
    async fn ungate(&mut self) {
        std::fs::remove_file(&self.gate).unwrap();
        let mut last = (Value::Null, Value::Null);
        let back = became(Duration::from_secs(30), async || {
            last = (self.host().await, self.now().await);
            last.0["state"] == "running" && last.1["worker_supervised"] == true
        })
        .await;
        if !back {
            self.findings.push(format!(
                "after the fault, supervision did not say it runs again: host {}, volume worker_supervised {}",
                last.0, last.1["worker_supervised"]
            ));
        }
    }

    /// Kills the worker serving now, unless `dead` (killed already); the
    /// volume's device must be recovered by a new worker and take a write.
    async fn recovers(&mut self, old: u64, kill: bool) {
        if kill {
            let pid = self.now().await["worker_pid"].as_u64().unwrap_or(old);
            sh("kill", &["-9", &pid.to_string()]);
        }
        let mut last = Value::Null;
        let back = became(Duration::from_secs(60), async || {
            last = self.now().await;
            last["worker_pid"].as_u64().is_some_and(|p| p != old) && last["state"] == "attached"
        })
        .await;
        if !back {
            self.findings.push(format!(
                "the killed worker {old} was never replaced within 60 s: state {}, state_reason {}, worker_pid {}",
                last["state"], last["state_reason"], last["worker_pid"]
            ));
            return;
        }
        let dev = self.volume["device"].as_str().unwrap();
        let w = direct_write(dev);
        if !w.status.success() {
            self.findings.push(format!(
                "a write to {dev} after the recovery failed: {}",
                String::from_utf8_lossy(&w.stderr)
            ));
        }
        let kinds = self
            .vm
            .event_kinds(self.volume["id"].as_str().unwrap())
            .await;
        if !kinds.contains(&"worker_restarted".to_string()) {
            self.findings
                .push(format!("no worker_restarted event: {kinds:?}"));
        }
    }

    async fn done(self, fault: &str) {
        assert!(
            self.findings.is_empty(),
            "under {fault}:\n- {}",
            self.findings.join("\n- ")
        );
        self.vm.delete("s").await;
    }
}

/// A supervisor whose wait fails (or that panics) says so while it cannot
/// run, restarts itself, and once it runs a killed worker is recovered.
async fn the_supervisor_comes_back(fault: &str, why: &str) {
    let mut a = Armed::start(fault).await;
    let pid = a.pid();
    a.says_why_while_gated(true, why).await;
    a.ungate().await;
    a.recovers(pid, true).await;
    let text = a.vm.s.get_text("/metrics").await;
    if !text.contains("blockplane_worker_supervisor_running 1") {
        a.findings.push(
            "after the fault, /metrics did not say blockplane_worker_supervisor_running 1".into(),
        );
    }
    a.done(fault).await;
}

/// The supervisor starts with the service (and, before, with its first
/// worker): a service restarted while its thread cannot start adopts its
/// workers unsupervised, says so, and starts it once it can.
#[tokio::test(flavor = "multi_thread")]
async fn a_supervisor_that_cannot_start_says_so_and_starts_later() {
    let vm = Vm::start().await;
    let gate = vm.s.data.join("run").join("supervisor-gate");
    let mut a = Armed::with_volume(vm, gate).await;
    let pid = a.pid();
    a.vm.s.kill();
    std::fs::write(&a.gate, b"").unwrap();
    a.vm.start_with_fault("fail_supervisor_start").await;
    let now = a.now().await;
    if now["worker_pid"].as_u64() != Some(pid) {
        a.findings.push(format!(
            "the restarted service did not adopt worker {pid}: {now}"
        ));
    }
    a.says_why_while_gated(true, "could not start").await;
    a.ungate().await;
    a.recovers(pid, true).await;
    a.done("fail_supervisor_start").await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_supervisor_whose_wait_fails_says_so_and_restarts() {
    the_supervisor_comes_back("fail_supervisor_wait", "Input/output error").await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_supervisor_that_panics_says_so_and_restarts() {
    the_supervisor_comes_back("panic_supervisor", "panicked").await;
}

/// `pidfd_open` refused for want of descriptors (EMFILE) is not the
/// worker's death: the live worker keeps serving, is not "recovered" and
/// its volume not marked `error`; it says it is not supervised until the
/// watch is taken again, and then a kill of it is recovered.
#[tokio::test(flavor = "multi_thread")]
async fn a_worker_that_cannot_be_watched_is_not_taken_for_dead() {
    let mut a = Armed::start("emfile_pidfd").await;
    let pid = a.pid();
    a.says_why_while_gated(false, "Too many open files").await;
    let now = a.now().await;
    if now["worker_pid"].as_u64() != Some(pid)
        || !matches!(now["state"].as_str(), Some("attached" | "degraded"))
    {
        a.findings.push(format!(
            "the live worker {pid} was taken for dead: worker_pid {}, state {}, state_reason {}",
            now["worker_pid"], now["state"], now["state_reason"]
        ));
    }
    // Taken for dead, it would be "recovered" at once: a new worker asked
    // to recover the device its live worker still serves, refused (EBUSY,
    // after 30 s on 6.12) and tried again, ten times, then the volume
    // marked `error`.
    let log =
        a.vm.s
            .data
            .join("run/ublk")
            .join(a.volume["id"].as_str().unwrap())
            .join("worker.log");
    let log = std::fs::read_to_string(log).unwrap_or_default();
    if let Some(line) = log.lines().find(|l| l.contains("recover_dev_id")) {
        a.findings.push(format!(
            "the live worker {pid} was taken for dead: a worker was started to recover its device: {line}"
        ));
    }
    let kinds = a.vm.event_kinds(a.volume["id"].as_str().unwrap()).await;
    for bad in ["worker_restarted", "worker_recovery_failed"] {
        if kinds.contains(&bad.to_string()) {
            a.findings
                .push(format!("a live worker got a {bad} event: {kinds:?}"));
        }
    }
    a.ungate().await;
    a.recovers(pid, true).await;
    a.done("emfile_pidfd").await;
}

/// A recovery thread that cannot start is started again: the dead worker's
/// volume says it waits for its recovery meanwhile, and is recovered.
#[tokio::test(flavor = "multi_thread")]
async fn a_recovery_that_cannot_start_is_started_again() {
    let mut a = Armed::start("fail_recovery_spawn").await;
    let pid = a.pid();
    sh("kill", &["-9", &pid.to_string()]);
    a.says_why_while_gated(false, "recovery could not start")
        .await;
    a.ungate_only();
    a.recovers(pid, false).await;
    a.done("fail_recovery_spawn").await;
}

impl Armed {
    fn ungate_only(&self) {
        std::fs::remove_file(&self.gate).unwrap();
    }
}
