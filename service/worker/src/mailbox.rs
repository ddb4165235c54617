//! How the control thread reaches a queue thread. A queue thread owns
//! everything its requests touch (the policy and direct path in force,
//! read-only, the QoS limiter and its lease of tokens, counters,
//! histograms), so a request shares
//! nothing with other threads. Changes arrive as messages in the queue's
//! [`Mailbox`], and a write to the queue's eventfd ([`Kick`]) wakes the
//! thread, which keeps a read armed on it, to take them.

use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::mpsc::{self, RecvTimeoutError};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::stats::QueueReport;
use crate::direct_path::DirectPath;
use crate::{moment, qos};
use blockplane_protocol::DataPath;

/// A queue thread's eventfd.
#[derive(Debug)]
pub struct Kick {
    fd: OwnedFd,
}

impl Kick {
    /// A new eventfd.
    pub fn new() -> std::io::Result<Self> {
        let fd = rustix::event::eventfd(0, rustix::event::EventfdFlags::CLOEXEC)?;
        Ok(Self { fd })
    }

    /// The raw fd, for the queue's armed read.
    pub fn raw(&self) -> i32 {
        self.fd.as_raw_fd()
    }

    /// Makes the queue thread's `io_uring_enter` return.
    pub fn kick(&self) {
        let _ = rustix::io::write(&self.fd, &1u64.to_ne_bytes());
    }
}

/// What a queue serves with; replaced as a whole.
#[derive(Clone)]
pub struct QueueConfig {
    pub policy: DataPath,
    /// Set while the policy is `direct`.
    pub direct: Option<Arc<DirectPath>>,
    pub read_only: bool,
    /// `None`: no limit, and nothing to pay for one.
    pub qos: Option<Arc<qos::Limiter>>,
    /// The image is `full`: the file paths never punch it (DISCARD does
    /// nothing, WRITE_ZEROES writes zeros).
    pub keep_allocated: bool,
    /// A moment being copied (see [`moment`]): a write keeps the old bytes
    /// of its chunks first.
    pub moment: Option<Arc<moment::Moment>>,
}

/// A message for a queue thread. Each carries where to answer.
pub enum Msg {
    /// Stop admitting requests; answer once none is inside.
    Hold(mpsc::Sender<()>),
    /// Serve with this from now on and admit again; answer once in force.
    Apply(QueueConfig, mpsc::Sender<()>),
    /// Hand over the queue's histograms and in-flight count.
    Report(mpsc::Sender<QueueReport>),
    /// QoS tokens from the volume's QoS thread (see [`qos`]).
    Grant(qos::Grant),
}

/// One queue's inbox.
pub struct Mailbox {
    msgs: Mutex<Vec<Msg>>,
    kick: Kick,
}

impl Mailbox {
    /// An empty mailbox with its own eventfd.
    pub fn new() -> std::io::Result<Self> {
        Ok(Self {
            msgs: Mutex::default(),
            kick: Kick::new()?,
        })
    }

    /// The eventfd the queue thread keeps a read armed on.
    pub fn kick_fd(&self) -> i32 {
        self.kick.raw()
    }

    /// Leaves a message and wakes the queue thread.
    pub fn post(&self, m: Msg) {
        self.msgs.lock().expect("mailbox poisoned").push(m);
        self.kick.kick();
    }

    /// Everything left since the last look (the queue thread's side).
    pub fn take(&self) -> Vec<Msg> {
        std::mem::take(&mut *self.msgs.lock().expect("mailbox poisoned"))
    }
}

impl qos::Grantee for Mailbox {
    fn grant(&self, g: qos::Grant) {
        self.post(Msg::Grant(g));
    }
}

/// The control thread's side: a message to every queue, and their answers.
pub struct Queues(pub Vec<Arc<Mailbox>>);

impl Queues {
    /// Posts what `make` builds to every queue; where each will answer.
    fn post_all<T>(&self, make: impl Fn(mpsc::Sender<T>) -> Msg) -> Vec<mpsc::Receiver<T>> {
        self.0
            .iter()
            .map(|m| {
                let (tx, rx) = mpsc::channel();
                m.post(make(tx));
                rx
            })
            .collect()
    }

    /// Posts what `make` builds to every queue and collects the answers
    /// until `deadline`; `None` if a queue did not answer in time.
    fn ask<T>(&self, make: impl Fn(mpsc::Sender<T>) -> Msg, timeout: Duration) -> Option<Vec<T>> {
        let deadline = Instant::now() + timeout;
        let waiting = self.post_all(make);
        let mut out = Vec::with_capacity(waiting.len());
        for rx in waiting {
            let left = deadline.saturating_duration_since(Instant::now());
            match rx.recv_timeout(left) {
                Ok(v) => out.push(v),
                Err(RecvTimeoutError::Timeout | RecvTimeoutError::Disconnected) => return None,
            }
        }
        Some(out)
    }

    /// Holds new requests on every queue and waits for those inside to
    /// finish. Whether they did within `timeout`; the queues stay held
    /// either way until the next [`Queues::apply`].
    pub fn hold(&self, timeout: Duration) -> bool {
        self.ask(Msg::Hold, timeout).is_some()
    }

    /// Puts `cfg` in force on every queue (and lets held requests in).
    pub fn apply(&self, cfg: &QueueConfig) -> bool {
        self.ask(|tx| Msg::Apply(cfg.clone(), tx), Duration::from_secs(30))
            .is_some()
    }

    /// Every queue's report, or those of the queues that answered in time.
    pub fn reports(&self) -> Vec<QueueReport> {
        let waiting = self.post_all(Msg::Report);
        let deadline = Instant::now() + Duration::from_secs(2);
        waiting
            .into_iter()
            .filter_map(|rx| {
                rx.recv_timeout(deadline.saturating_duration_since(Instant::now()))
                    .ok()
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A stand-in queue thread: takes messages when kicked, with `inside`
    /// requests in flight until told to finish them.
    fn queue_thread(
        m: Arc<Mailbox>,
        mut inside: u64,
        finish: mpsc::Receiver<()>,
    ) -> std::thread::JoinHandle<Vec<DataPath>> {
        std::thread::spawn(move || {
            let mut drained = None;
            let mut applied = Vec::new();
            loop {
                let mut buf = [0u8; 8];
                let _ = rustix::io::read(&m.kick.fd, &mut buf);
                for msg in m.take() {
                    match msg {
                        Msg::Hold(done) if inside == 0 => done.send(()).unwrap(),
                        Msg::Hold(done) => drained = Some(done),
                        Msg::Apply(cfg, done) => {
                            applied.push(cfg.policy);
                            done.send(()).unwrap();
                            if cfg.policy == DataPath::Direct {
                                return applied;
                            }
                        }
                        Msg::Report(to) => to
                            .send(QueueReport {
                                in_flight: inside,
                                ..Default::default()
                            })
                            .unwrap(),
                        Msg::Grant(_) => {}
                    }
                }
                if finish.try_recv().is_ok() {
                    inside = 0;
                    // The first hold gave up waiting: nobody may be listening.
                    if let Some(d) = drained.take() {
                        let _ = d.send(());
                    }
                }
            }
        })
    }

    #[test]
    fn a_hold_waits_for_the_requests_inside_and_an_apply_reaches_every_queue() {
        let boxes: Vec<_> = (0..2).map(|_| Arc::new(Mailbox::new().unwrap())).collect();
        let (finish_tx, finish_rx) = mpsc::channel();
        let busy = queue_thread(boxes[0].clone(), 1, finish_rx);
        let (_idle_tx, idle_rx) = mpsc::channel();
        let idle = queue_thread(boxes[1].clone(), 0, idle_rx);
        let queues = Queues(boxes.clone());
        assert_eq!(queues.reports().iter().map(|r| r.in_flight).sum::<u64>(), 1);
        assert!(
            !queues.hold(Duration::from_millis(200)),
            "a request is still inside queue 0"
        );
        finish_tx.send(()).unwrap();
        boxes[0].kick.kick();
        assert!(queues.hold(Duration::from_secs(5)));
        let cfg = QueueConfig {
            policy: DataPath::Direct,
            direct: None,
            read_only: false,
            qos: None,
            keep_allocated: false,
            moment: None,
        };
        assert!(queues.apply(&cfg));
        assert_eq!(busy.join().unwrap(), vec![DataPath::Direct]);
        assert_eq!(idle.join().unwrap(), vec![DataPath::Direct]);
    }
}
