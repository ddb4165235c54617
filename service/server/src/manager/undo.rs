//! One operation's undo, newest first: each step that changes the world (a
//! file made, a header written, a live change on a device) is pushed with
//! its name, and taken back newest first if the operation fails.
//!
//! Two ways to take the steps back, one stack:
//! - An operation whose steps undo themselves at once (an [`Action`]: a
//!   file removed) lets the undo drop: if it ends before [`Undo::commit`]
//!   (an error returned with `?`, a panic), the steps run as the undo is
//!   dropped, so a refused operation leaves nothing behind without each
//!   exit remembering to clean.
//! - An operation whose undo must wait on the device and can fail (a PATCH's
//!   live changes) calls [`Undo::unwind`] with how to take one step back:
//!   the first that fails stops it, and it and the steps older than it stay,
//!   as the world then is, for the caller to record.

use std::fmt::Display;
use std::future::Future;

/// A step that takes itself back, at once.
pub(super) type Action = Box<dyn FnOnce() + Send>;

/// What a step does when its undo is dropped neither committed nor unwound.
pub(super) trait Step {
    /// Takes the step back now, or says that it stays.
    fn on_drop(self, what: &'static str);
}

impl Step for Action {
    fn on_drop(self, what: &'static str) {
        tracing::debug!(step = what, "undoing");
        self();
    }
}

/// The steps to take back, oldest first, each with its name for the log.
pub(super) struct Undo<S: Step = Action> {
    steps: Vec<(&'static str, S)>,
}

impl<S: Step> Default for Undo<S> {
    fn default() -> Self {
        Self { steps: Vec::new() }
    }
}

impl<S: Step> Undo<S> {
    /// Adds a step, `what` naming it for the log.
    pub fn push_step(&mut self, what: &'static str, step: S) {
        self.steps.push((what, step));
    }

    /// How many steps there are to take back.
    pub fn len(&self) -> usize {
        self.steps.len()
    }

    /// The operation is done: nothing is taken back. The steps it made,
    /// oldest first.
    pub fn commit(mut self) -> Vec<S> {
        std::mem::take(&mut self.steps)
            .into_iter()
            .map(|(_, s)| s)
            .collect()
    }

    /// Takes the steps back newest first with `undo`, which is given what
    /// the previous undo left (`state` first: a device's attachment) and a
    /// copy of the step, and gives back the new state, or the state as it
    /// was with why it failed (the caller says so where it matters). The
    /// first that fails stops it: the state after, and the steps that stay
    /// (the one that failed and those older), oldest first.
    pub async fn unwind<T, E, F>(
        mut self,
        mut state: T,
        mut undo: impl FnMut(T, S) -> F,
    ) -> (T, Vec<S>)
    where
        S: Clone,
        E: Display,
        F: Future<Output = Result<T, (T, E)>>,
    {
        while let Some((what, step)) = self.steps.last().cloned() {
            tracing::debug!(step = what, "undoing");
            match undo(state, step).await {
                Ok(after) => state = after,
                Err((unchanged, e)) => {
                    tracing::debug!(step = what, error = %e, "could not undo");
                    return (unchanged, self.commit());
                }
            }
            self.steps.pop();
        }
        (state, self.commit())
    }
}

impl Undo<Action> {
    /// Adds a step that takes itself back, `what` naming it for the log.
    pub fn push(&mut self, what: &'static str, step: impl FnOnce() + Send + 'static) {
        self.push_step(what, Box::new(step));
    }
}

impl<S: Step> Drop for Undo<S> {
    fn drop(&mut self) {
        while let Some((what, step)) = self.steps.pop() {
            step.on_drop(what);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::{Arc, Mutex};

    fn logged(
        log: &Arc<Mutex<Vec<&'static str>>>,
        what: &'static str,
    ) -> impl FnOnce() + Send + use<> {
        let log = log.clone();
        move || log.lock().unwrap().push(what)
    }

    #[test]
    fn a_dropped_undo_takes_its_steps_back_newest_first_and_a_committed_one_none() {
        let log = Arc::new(Mutex::new(Vec::new()));
        let mut undo = Undo::default();
        undo.push("file", logged(&log, "remove the file"));
        undo.push("header", logged(&log, "wipe the header"));
        drop(undo);
        assert_eq!(*log.lock().unwrap(), ["wipe the header", "remove the file"]);
        log.lock().unwrap().clear();
        let mut undo = Undo::default();
        undo.push("file", logged(&log, "remove the file"));
        undo.commit();
        assert!(log.lock().unwrap().is_empty());
    }

    /// A step that stays when its undo is dropped: a live change.
    #[derive(Debug, Clone, PartialEq)]
    struct Change(u8);

    impl Step for Change {
        fn on_drop(self, _: &'static str) {}
    }

    #[tokio::test]
    async fn an_unwind_stops_at_the_first_step_that_cannot_be_taken_back() {
        let mut undo = Undo::default();
        for n in 1..=3 {
            undo.push_step("change", Change(n));
        }
        let (tried, stays) = undo
            .unwind(Vec::new(), |mut tried: Vec<u8>, c: Change| async move {
                tried.push(c.0);
                if c.0 == 2 {
                    Err((tried, "refused"))
                } else {
                    Ok(tried)
                }
            })
            .await;
        assert_eq!(tried, [3, 2]);
        assert_eq!(stays, [Change(1), Change(2)]);
    }
}
