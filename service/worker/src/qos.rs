//! Per-volume QoS: token buckets for IOPS and bandwidth (reads and writes
//! together). A request over the limit waits (never a failure); limits change
//! live. A volume without limits has no limiter at all, so it pays nothing.
//!
//! One thread of the worker (`qos`) owns the volume's buckets and leases
//! their tokens to the queues in batches. A queue spends its own batch (its
//! [`Lease`]) with no lock and no shared atomic; when the batch runs short it
//! asks the QoS thread for more and its requests wait, in the queue's own
//! executor, until the grant arrives in its mailbox. Every token comes from
//! the one set of buckets, so the volume admits at most `burst + rate × t` in
//! any `t` however its requests spread over the queues. A grant is what the
//! request needs or more: while tokens are plenty, a fair part of them (so a
//! burst is spent in a few grants), while they are short, [`LEASE`] of the
//! rate, or one request's cost if more. So the tokens move between the
//! threads in periodic batches, off the per-request path: a queue asks at
//! most once per `LEASE` (at most 50 times a second) however many requests
//! it serves, or, under a limit below one request per `LEASE`, once per
//! request the limit lets through. Tokens a queue was granted and did not spend before it went
//! idle stay with it: the volume then admits a little less than its limit,
//! never more.

use std::cell::RefCell;
use std::sync::Arc;
use std::sync::mpsc::{self, RecvTimeoutError};
use std::task::{Poll, Waker};
use std::time::{Duration, Instant};

use blockplane_protocol::Limits;

/// The share of a second's rate a grant covers while tokens are short: the
/// period at which a throttled queue asks for more.
const LEASE: Duration = Duration::from_millis(20);

#[derive(Debug, Clone, Copy)]
struct Bucket {
    rate: f64,
    burst: f64,
    tokens: f64,
}

impl Bucket {
    fn new(rate: u64, burst: Option<u64>) -> Self {
        let burst = burst.unwrap_or(rate).max(1) as f64;
        Self {
            rate: rate as f64,
            burst,
            tokens: burst,
        }
    }

    fn refill(&mut self, secs: f64) {
        self.tokens = (self.tokens + self.rate * secs).min(self.burst);
    }

    /// What a grant that must cover `need` takes while tokens are short.
    fn target(&self, need: f64) -> f64 {
        need.max((self.rate * LEASE.as_secs_f64()).min(self.burst))
    }

    /// Time until `target` tokens are there (zero if they are).
    fn wait_for(&self, target: f64) -> Duration {
        let short = target - self.tokens;
        if short <= 0.0 {
            Duration::ZERO
        } else {
            Duration::from_secs_f64(short / self.rate)
        }
    }

    /// Takes at least `target` (there) and up to a fair part of the rest.
    fn take(&mut self, target: f64, queues: usize) -> f64 {
        let part = (self.tokens / (2 * queues.max(1)) as f64).max(target);
        let granted = part.min(self.tokens);
        self.tokens -= granted;
        granted
    }
}

/// What a request costs, or a grant gives: operations and bytes (zero in a
/// dimension the volume does not limit).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Cost {
    pub ops: f64,
    pub bytes: f64,
}

/// The volume's buckets, owned by the QoS thread.
#[derive(Debug)]
struct Buckets {
    iops: Option<Bucket>,
    bytes: Option<Bucket>,
    last: Instant,
}

impl Buckets {
    fn new(q: &Limits, now: Instant) -> Self {
        Self {
            iops: q.iops.map(|r| Bucket::new(r, q.burst_iops)),
            bytes: q.bytes_per_sec.map(|r| Bucket::new(r, q.burst_bytes)),
            last: now,
        }
    }

    /// A grant covering `need` now, or how long until one can.
    fn grant(&mut self, need: Cost, queues: usize, now: Instant) -> Result<Cost, Duration> {
        let secs = now.saturating_duration_since(self.last).as_secs_f64();
        self.last = now;
        let mut wait = Duration::ZERO;
        for (bucket, need) in [(&mut self.iops, need.ops), (&mut self.bytes, need.bytes)] {
            if let Some(b) = bucket {
                b.refill(secs);
                wait = wait.max(b.wait_for(b.target(need)));
            }
        }
        if !wait.is_zero() {
            return Err(wait);
        }
        let take = |bucket: &mut Option<Bucket>, need: f64| {
            bucket
                .as_mut()
                .map_or(0.0, |b| b.take(b.target(need), queues))
        };
        Ok(Cost {
            ops: take(&mut self.iops, need.ops),
            bytes: take(&mut self.bytes, need.bytes),
        })
    }
}

/// Where a queue's tokens are granted to (its mailbox): a trait, so that
/// this module knows nothing of how a queue gets its messages.
pub trait Grantee: Send + Sync {
    /// Hands `g` to the queue and wakes it.
    fn grant(&self, g: Grant);
}

/// A queue's ask for tokens; answered with a [`Grant`] to `to`.
struct Ask {
    need: Cost,
    to: Arc<dyn Grantee>,
}

/// Tokens granted to a queue by its QoS thread.
#[derive(Debug, Clone, Copy)]
pub struct Grant {
    /// The limiter that granted them.
    pub limiter: u64,
    pub tokens: Cost,
    /// The buckets were short when asked: the requests waiting for this
    /// grant were held back by the limit.
    pub late: bool,
}

/// The limiter of one volume with limits, shared by its queues: what a
/// request costs, and where to ask for tokens. The buckets live on its QoS
/// thread, which ends when the limiter is dropped.
#[derive(Debug)]
pub struct Limiter {
    id: u64,
    burst: Cost,
    limited: (bool, bool),
    asks: mpsc::Sender<Ask>,
}

impl Limiter {
    /// A limiter for `qos` and its QoS thread, or `None` when it sets no
    /// limit. `queues`: how many queues share it (the size of a fair part).
    pub fn for_limits(qos: Option<Limits>, queues: usize) -> std::io::Result<Option<Arc<Self>>> {
        let Some(q) = qos.filter(|q| q.iops.is_some() || q.bytes_per_sec.is_some()) else {
            return Ok(None);
        };
        static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
        let id = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let buckets = Buckets::new(&q, Instant::now());
        let burst = Cost {
            ops: buckets.iops.map_or(0.0, |b| b.burst),
            bytes: buckets.bytes.map_or(0.0, |b| b.burst),
        };
        let (asks, rx) = mpsc::channel();
        std::thread::Builder::new()
            .name("qos".into())
            .spawn(move || serve(id, buckets, queues, rx))?;
        Ok(Some(Arc::new(Self {
            id,
            burst,
            limited: (q.iops.is_some(), q.bytes_per_sec.is_some()),
            asks,
        })))
    }

    /// Which limiter this is (a grant names the one it came from).
    pub fn id(&self) -> u64 {
        self.id
    }

    /// What a request of `len` bytes costs (one larger than the burst costs
    /// the burst: it waits for a full bucket, then goes).
    fn cost(&self, len: u32) -> Cost {
        Cost {
            ops: if self.limited.0 {
                1f64.min(self.burst.ops)
            } else {
                0.0
            },
            bytes: if self.limited.1 {
                f64::from(len).min(self.burst.bytes)
            } else {
                0.0
            },
        }
    }
}

/// The QoS thread: answers asks in order, each once its grant is there.
fn serve(id: u64, mut buckets: Buckets, queues: usize, rx: mpsc::Receiver<Ask>) {
    let mut waiting: std::collections::VecDeque<(Ask, bool)> = Default::default();
    let mut wait = Duration::ZERO;
    loop {
        let next = if waiting.is_empty() {
            rx.recv().map_err(|_| RecvTimeoutError::Disconnected)
        } else {
            rx.recv_timeout(wait)
        };
        match next {
            Ok(ask) => waiting.push_back((ask, false)),
            Err(RecvTimeoutError::Timeout) => {}
            Err(RecvTimeoutError::Disconnected) => return,
        }
        while let Some((ask, late)) = waiting.front_mut() {
            match buckets.grant(ask.need, queues, Instant::now()) {
                Ok(tokens) => {
                    let late = *late;
                    if let Some((ask, _)) = waiting.pop_front() {
                        ask.to.grant(Grant {
                            limiter: id,
                            tokens,
                            late,
                        });
                    }
                }
                Err(w) => {
                    *late = true;
                    wait = w;
                    break;
                }
            }
        }
    }
}

/// A queue's part of its volume's QoS, owned by the queue thread: tokens
/// granted and not yet spent, and the requests waiting for more.
#[derive(Debug, Default)]
pub struct Lease {
    /// The limiter the tokens came from (a new limit voids them).
    limiter: u64,
    tokens: Cost,
    /// An ask is out: no second one until its grant arrives.
    asked: bool,
    /// Late grants so far: a request that waited across one was throttled.
    late: u64,
    waiters: Vec<Waker>,
}

impl Lease {
    /// Takes a grant; returns the requests to wake.
    pub fn receive(&mut self, g: Grant) -> Vec<Waker> {
        if g.limiter != self.limiter {
            // Asked of a limiter replaced since: its tokens are void.
            return Vec::new();
        }
        self.tokens.ops += g.tokens.ops;
        self.tokens.bytes += g.tokens.bytes;
        self.asked = false;
        self.late += u64::from(g.late);
        std::mem::take(&mut self.waiters)
    }

    /// Voids the lease (the limits changed); returns the requests to wake,
    /// which look again with the limiter in force.
    pub fn void(&mut self) -> Vec<Waker> {
        let late = self.late;
        let waiters = std::mem::take(&mut self.waiters);
        *self = Self {
            late,
            ..Self::default()
        };
        waiters
    }
}

/// Waits until the queue's lease covers a request of `len` bytes under the
/// limiter `current` gives (none: no limit, go), and spends it. Whether the
/// request was held back by the limit.
pub async fn admit<'a>(
    current: impl Fn() -> Option<std::cell::Ref<'a, Limiter>>,
    lease: &RefCell<Lease>,
    mailbox: &Arc<impl Grantee + 'static>,
    len: u32,
) -> bool {
    let mut first_late = None;
    std::future::poll_fn(|cx| {
        let Some(limiter) = current() else {
            return Poll::Ready(false);
        };
        let mut l = lease.borrow_mut();
        if l.limiter != limiter.id {
            let waiters = l.void();
            l.limiter = limiter.id;
            drop(l);
            waiters.into_iter().for_each(Waker::wake);
            l = lease.borrow_mut();
        }
        let cost = limiter.cost(len);
        // A grant is whole tokens or more: the slack only absorbs rounding.
        let slack = 1e-9;
        if l.tokens.ops + slack >= cost.ops && l.tokens.bytes + slack >= cost.bytes {
            l.tokens.ops -= cost.ops;
            l.tokens.bytes -= cost.bytes;
            return Poll::Ready(first_late.is_some_and(|at| at != l.late));
        }
        first_late.get_or_insert(l.late);
        if !l.asked {
            let need = Cost {
                ops: (cost.ops - l.tokens.ops).max(0.0),
                bytes: (cost.bytes - l.tokens.bytes).max(0.0),
            };
            let ask = Ask {
                need,
                to: mailbox.clone() as Arc<dyn Grantee>,
            };
            if limiter.asks.send(ask).is_err() {
                // The QoS thread is gone (it never ends while its limiter
                // lives): serve rather than hang.
                tracing::error!("the QoS thread is gone; this request goes unlimited");
                return Poll::Ready(false);
            }
            l.asked = true;
        }
        l.waiters.push(cx.waker().clone());
        Poll::Pending
    })
    .await
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ops(n: f64) -> Cost {
        Cost { ops: n, bytes: 0.0 }
    }

    /// A queue's side of the grants, as its mailbox would take them.
    #[derive(Default)]
    struct Grants(std::sync::Mutex<Vec<Grant>>);

    impl Grantee for Grants {
        fn grant(&self, g: Grant) {
            self.0.lock().unwrap().push(g);
        }
    }

    #[test]
    fn buckets_grant_the_burst_then_pace() {
        let q = Limits {
            iops: Some(100),
            burst_iops: Some(10),
            ..Default::default()
        };
        let t0 = Instant::now();
        let mut b = Buckets::new(&q, t0);
        // The burst goes at once, in grants of at least what is asked, never
        // more than there is.
        let mut granted = 0.0;
        while let Ok(g) = b.grant(ops(1.0), 1, t0) {
            assert!(g.ops >= 1.0, "{g:?}");
            granted += g.ops;
        }
        assert!(granted > 9.0 && granted <= 10.0, "{granted}");
        // Then the rate, in leases: 20 ms of it (two tokens, less the part
        // of one left), however little is asked.
        let wait = b.grant(ops(1.0), 1, t0).unwrap_err();
        assert!(
            wait > Duration::from_millis(10) && wait <= Duration::from_millis(20),
            "{wait:?}"
        );
        let later = t0 + wait + Duration::from_millis(1);
        let g = b.grant(ops(1.0), 1, later).unwrap();
        assert!((g.ops - 2.0).abs() < 1e-9, "{g:?}");

        // Bytes: a request larger than the burst waits for a full bucket.
        let q = Limits {
            bytes_per_sec: Some(1 << 20),
            ..Default::default()
        };
        let mut b = Buckets::new(&q, t0);
        let g = b.grant(
            Cost {
                ops: 0.0,
                bytes: f64::from(1u32 << 20),
            },
            1,
            t0,
        );
        assert_eq!(g.unwrap().bytes, f64::from(1u32 << 20));
        let wait = b
            .grant(
                Cost {
                    ops: 0.0,
                    bytes: f64::from(512u32 << 10),
                },
                1,
                t0,
            )
            .unwrap_err();
        assert_eq!(wait, Duration::from_millis(500));
    }

    #[test]
    fn no_limit_no_limiter() {
        assert!(
            Limiter::for_limits(Some(Limits::default()), 2)
                .unwrap()
                .is_none()
        );
        assert!(Limiter::for_limits(None, 2).unwrap().is_none());
    }

    /// Two queues asking as fast as their grants come: together they get at
    /// most the burst plus the rate over the time they asked, however the
    /// grants split between them.
    #[test]
    fn queues_asking_at_once_share_one_limit() {
        let limiter = Limiter::for_limits(
            Some(Limits {
                iops: Some(2000),
                burst_iops: Some(100),
                ..Default::default()
            }),
            2,
        )
        .unwrap()
        .unwrap();
        let started = Instant::now();
        let run = Duration::from_millis(300);
        let queues: Vec<_> = (0..2)
            .map(|_| {
                let asks = limiter.asks.clone();
                std::thread::spawn(move || {
                    let mailbox = Arc::new(Grants::default());
                    let mut got = 0.0;
                    // Each asks once at least, however late its thread runs.
                    loop {
                        let ask = Ask {
                            need: ops(1.0),
                            to: mailbox.clone(),
                        };
                        asks.send(ask).unwrap();
                        loop {
                            let grants: Vec<_> = std::mem::take(&mut *mailbox.0.lock().unwrap())
                                .into_iter()
                                .map(|g| g.tokens.ops)
                                .collect();
                            if !grants.is_empty() {
                                got += grants.iter().sum::<f64>();
                                break;
                            }
                            std::thread::yield_now();
                        }
                        if started.elapsed() >= run {
                            break;
                        }
                    }
                    got
                })
            })
            .collect();
        let got: Vec<f64> = queues.into_iter().map(|q| q.join().unwrap()).collect();
        let secs = started.elapsed().as_secs_f64();
        let total: f64 = got.iter().sum();
        assert!(
            total <= 100.0 + 2000.0 * secs + 1e-6,
            "{got:?} in {secs:.3} s: more than the burst and the rate"
        );
        assert!(got.iter().all(|g| *g > 0.0), "a queue got nothing: {got:?}");
    }
}
