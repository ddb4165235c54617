//! A queue's gate: a policy switch holds new requests at it until the next
//! config, and learns there when the requests inside have finished. One
//! queue's thread owns its gate; nothing in it is shared.

use std::cell::{Cell, RefCell};
use std::sync::mpsc::Sender;
use std::task::{Poll, Waker};

/// Whether a queue lets new requests in, how many are inside, and who
/// waits at it.
#[derive(Default)]
pub(crate) struct Gate {
    /// A policy switch holds new requests until the next config.
    held: Cell<bool>,
    in_flight: Cell<u64>,
    /// Told when the last request inside a held queue finishes.
    drained: RefCell<Option<Sender<()>>>,
    /// The requests held at the gate.
    waiters: RefCell<Vec<Waker>>,
}

impl Gate {
    /// Holds new requests; `done` is told once none is inside (at once if
    /// none is).
    pub fn hold(&self, done: Sender<()>) {
        self.held.set(true);
        if self.in_flight.get() == 0 {
            let _ = done.send(());
        } else {
            *self.drained.borrow_mut() = Some(done);
        }
    }

    /// Lets the held requests in.
    pub fn open(&self) {
        self.held.set(false);
        for w in self.waiters.borrow_mut().drain(..) {
            w.wake();
        }
    }

    /// Waits while the gate is held.
    pub async fn admitted(&self) {
        std::future::poll_fn(|cx| {
            if self.held.get() {
                self.waiters.borrow_mut().push(cx.waker().clone());
                Poll::Pending
            } else {
                Poll::Ready(())
            }
        })
        .await
    }

    /// A request goes in.
    pub fn enter(&self) {
        self.in_flight.set(self.in_flight.get() + 1);
    }

    /// A request comes out; the last one out of a held queue tells the
    /// switch waiting for it.
    pub fn leave(&self) {
        self.in_flight.set(self.in_flight.get() - 1);
        if self.held.get()
            && self.in_flight.get() == 0
            && let Some(done) = self.drained.borrow_mut().take()
        {
            let _ = done.send(());
        }
    }

    /// The requests inside.
    pub fn in_flight(&self) -> u64 {
        self.in_flight.get()
    }
}
