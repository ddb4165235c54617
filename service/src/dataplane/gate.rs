//! Cross-thread wake-ups into a queue thread, and the gate a policy switch
//! closes to drain a queue.
//!
//! A queue thread runs its tag tasks on a local executor and sleeps in
//! `io_uring_enter`: waking a task from another thread (a pool worker, the
//! control thread) needs both the task's waker and a write to the queue's
//! eventfd, on which the queue keeps a read armed ([`Kick`]).

use std::future::Future;
use std::os::fd::{AsRawFd, OwnedFd};
use std::pin::Pin;
use std::sync::{Arc, Condvar, Mutex};
use std::task::{Context, Poll, Waker};
use std::time::{Duration, Instant};

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

/// A one-shot result handed from another thread to a task on a queue thread.
#[derive(Debug, Default)]
pub struct Slot {
    inner: Mutex<(Option<i32>, Option<Waker>)>,
}

impl Slot {
    /// Delivers the result and wakes the waiting task (and its queue thread).
    pub fn fill(&self, res: i32, kick: &Kick) {
        let waker = {
            let mut g = self.inner.lock().expect("slot poisoned");
            g.0 = Some(res);
            g.1.take()
        };
        if let Some(w) = waker {
            w.wake();
        }
        kick.kick();
    }

    /// Waits for the result.
    pub fn wait(self: &Arc<Self>) -> SlotFuture {
        SlotFuture(self.clone())
    }
}

/// Resolves when its [`Slot`] is filled.
pub struct SlotFuture(Arc<Slot>);

impl Future for SlotFuture {
    type Output = i32;
    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<i32> {
        let mut g = self.0.inner.lock().expect("slot poisoned");
        match g.0.take() {
            Some(r) => Poll::Ready(r),
            None => {
                g.1 = Some(cx.waker().clone());
                Poll::Pending
            }
        }
    }
}

#[derive(Debug, Default)]
struct GateState {
    closed: bool,
    in_flight: u64,
    waiters: Vec<Waker>,
}

/// Admits requests to a queue's data path; closing it lets the requests
/// inside finish and holds new ones until it opens again.
#[derive(Debug)]
pub struct Gate {
    state: Mutex<GateState>,
    drained: Condvar,
    kick: Arc<Kick>,
}

impl Gate {
    /// An open gate whose queue thread is woken through `kick`.
    pub fn new(kick: Arc<Kick>) -> Self {
        Self {
            state: Mutex::default(),
            drained: Condvar::new(),
            kick,
        }
    }

    /// Waits until the gate is open, then holds a place inside it.
    pub fn enter(self: &Arc<Self>) -> Enter {
        Enter(self.clone())
    }

    /// Closes the gate and waits until nothing is inside, up to `timeout`.
    /// Returns whether it drained; the gate stays closed either way.
    pub fn close_and_drain(&self, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        let mut g = self.state.lock().expect("gate poisoned");
        g.closed = true;
        while g.in_flight > 0 {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return false;
            }
            g = self.drained.wait_timeout(g, left).expect("gate poisoned").0;
        }
        true
    }

    /// Opens the gate and lets the held requests in.
    pub fn open(&self) {
        let waiters = {
            let mut g = self.state.lock().expect("gate poisoned");
            g.closed = false;
            std::mem::take(&mut g.waiters)
        };
        for w in waiters {
            w.wake();
        }
        self.kick.kick();
    }

    /// Requests inside now.
    pub fn in_flight(&self) -> u64 {
        self.state.lock().expect("gate poisoned").in_flight
    }
}

/// The future of [`Gate::enter`].
pub struct Enter(Arc<Gate>);

impl Future for Enter {
    type Output = Permit;
    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Permit> {
        let mut g = self.0.state.lock().expect("gate poisoned");
        if g.closed {
            g.waiters.push(cx.waker().clone());
            return Poll::Pending;
        }
        g.in_flight += 1;
        Poll::Ready(Permit(self.0.clone()))
    }
}

/// A place inside a [`Gate`], given back on drop.
pub struct Permit(Arc<Gate>);

impl Drop for Permit {
    fn drop(&mut self) {
        let mut g = self.0.state.lock().expect("gate poisoned");
        g.in_flight -= 1;
        if g.closed && g.in_flight == 0 {
            self.0.drained.notify_all();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_closed_gate_drains_holds_and_releases() {
        let gate = Arc::new(Gate::new(Arc::new(Kick::new().unwrap())));
        let inside = smol::block_on(gate.enter());
        assert_eq!(gate.in_flight(), 1);
        let g2 = gate.clone();
        let closer = std::thread::spawn(move || g2.close_and_drain(Duration::from_secs(5)));
        std::thread::sleep(Duration::from_millis(50));
        assert!(
            !closer.is_finished(),
            "closing waits for the request inside"
        );
        drop(inside);
        assert!(closer.join().unwrap());
        // Held while closed.
        let exe = smol::LocalExecutor::new();
        let g3 = gate.clone();
        let task = exe.spawn(async move { drop(g3.enter().await) });
        for _ in 0..10 {
            exe.try_tick();
        }
        assert!(!task.is_finished());
        gate.open();
        smol::block_on(exe.run(task));
        assert!(!gate.close_and_drain(Duration::ZERO) || gate.in_flight() == 0);
    }

    #[test]
    fn a_slot_hands_a_result_across_threads() {
        let kick = Arc::new(Kick::new().unwrap());
        let slot = Arc::new(Slot::default());
        let (s2, k2) = (slot.clone(), kick.clone());
        std::thread::spawn(move || s2.fill(42, &k2));
        assert_eq!(smol::block_on(slot.wait()), 42);
    }
}
