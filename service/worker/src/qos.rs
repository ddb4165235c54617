//! Per-volume QoS: token buckets for IOPS and bandwidth (reads and writes
//! together). A request over the limit waits on an io_uring timeout on its own
//! queue's ring (never a failure); limits change live. A volume without
//! limits has no limiter at all, so it pays nothing; one with limits shares
//! its buckets between its queues, which keeps the limit whole however the
//! requests spread over the queues.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use io_uring::{opcode, types};
use libublk::io::UblkQueue;

use super::stats::{QueueCounters, bump};
use blockplane_api::model::Qos;

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

    /// Time until `cost` tokens are there (zero if they are).
    fn wait_for(&self, cost: f64) -> Duration {
        // A request larger than the burst waits for a full bucket, then goes.
        let need = cost.min(self.burst) - self.tokens;
        if need <= 0.0 {
            Duration::ZERO
        } else {
            Duration::from_secs_f64(need / self.rate)
        }
    }
}

#[derive(Debug)]
struct Buckets {
    iops: Option<Bucket>,
    bytes: Option<Bucket>,
    last: Instant,
}

/// The limiter of one volume with limits (shared by its queues).
#[derive(Debug)]
pub struct Limiter {
    buckets: Mutex<Buckets>,
}

impl Limiter {
    /// A limiter for `qos`, or `None` when it sets no limit.
    pub fn for_limits(qos: Option<Qos>) -> Option<Arc<Self>> {
        let q = qos?;
        let iops = q.iops.map(|r| Bucket::new(r, q.burst_iops));
        let bytes = q.bytes_per_sec.map(|r| Bucket::new(r, q.burst_bytes));
        (iops.is_some() || bytes.is_some()).then(|| {
            Arc::new(Self {
                buckets: Mutex::new(Buckets {
                    iops,
                    bytes,
                    last: Instant::now(),
                }),
            })
        })
    }

    /// Takes tokens now, or says how long to wait for them.
    fn try_take(&self, len: u64) -> Duration {
        self.try_take_at(len, Instant::now())
    }

    /// [`Self::try_take`] at the instant `now` (not before the last take).
    fn try_take_at(&self, len: u64, now: Instant) -> Duration {
        let mut g = self.buckets.lock().expect("qos poisoned");
        let b = &mut *g;
        let secs = now.saturating_duration_since(b.last).as_secs_f64();
        b.last = now;
        let mut wait = Duration::ZERO;
        for (bucket, cost) in [(&mut b.iops, 1.0), (&mut b.bytes, len as f64)] {
            if let Some(k) = bucket {
                k.refill(secs);
                wait = wait.max(k.wait_for(cost));
            }
        }
        if wait.is_zero() {
            for (bucket, cost) in [(&mut b.iops, 1.0), (&mut b.bytes, len as f64)] {
                if let Some(k) = bucket {
                    k.tokens -= cost.min(k.burst);
                }
            }
        }
        wait
    }

    /// Waits (on the queue's ring) until the request fits the limits.
    pub async fn admit(&self, q: &UblkQueue<'_>, len: u32, counters: &QueueCounters) {
        let mut throttled = false;
        loop {
            let wait = self.try_take(u64::from(len));
            if wait.is_zero() {
                return;
            }
            if !throttled {
                bump(&counters.qos_throttled, 1);
                throttled = true;
            }
            // Lives in this future's frame, which stays put until the
            // timeout completes.
            let ts = types::Timespec::from(wait);
            let sqe = opcode::Timeout::new(&ts as *const types::Timespec).build();
            // -ETIME is the timeout firing: the expected outcome.
            let _ = q.ublk_submit_sqe(sqe).await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_admit_bursts_then_pace() {
        // Taken at instants the test sets, not at the clock's: the waits are
        // exact however slowly the test runs.
        let l = Limiter::for_limits(Some(Qos {
            iops: Some(100),
            burst_iops: Some(10),
            ..Default::default()
        }))
        .unwrap();
        let t0 = Instant::now();
        for _ in 0..10 {
            assert!(l.try_take_at(4096, t0).is_zero());
        }
        assert_eq!(l.try_take_at(4096, t0), Duration::from_millis(10));
        let half = l.try_take_at(4096, t0 + Duration::from_millis(5));
        assert!(
            half.abs_diff(Duration::from_millis(5)) < Duration::from_micros(1),
            "{half:?}"
        );
        assert!(
            l.try_take_at(4096, t0 + Duration::from_millis(20))
                .is_zero()
        );
        assert!(
            Limiter::for_limits(Some(Qos::default())).is_none(),
            "no limit, no limiter"
        );
        let l = Limiter::for_limits(Some(Qos {
            bytes_per_sec: Some(1 << 20),
            ..Default::default()
        }))
        .unwrap();
        let t0 = Instant::now();
        assert!(l.try_take_at(1 << 20, t0).is_zero());
        assert_eq!(l.try_take_at(512 << 10, t0), Duration::from_millis(500));
    }
}
