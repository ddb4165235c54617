//! One operation's undo, newest first: each step that changes the world (a
//! file made, a header written) pushes how to take itself back. If the
//! operation ends before [`Undo::commit`] (an error returned with `?`, a
//! panic), the steps run as the undo is dropped, newest first, so a refused
//! operation leaves nothing behind without each exit remembering to clean.

/// How to take one step back, and its name for the log.
type Step = (&'static str, Box<dyn FnOnce() + Send>);

/// The steps to take back, oldest first.
#[derive(Default)]
pub(super) struct Undo {
    steps: Vec<Step>,
}

impl Undo {
    /// Adds a step, `what` naming it for the log.
    pub fn push(&mut self, what: &'static str, step: impl FnOnce() + Send + 'static) {
        self.steps.push((what, Box::new(step)));
    }

    /// The operation is done: nothing is taken back.
    pub fn commit(mut self) {
        self.steps.clear();
    }
}

impl Drop for Undo {
    fn drop(&mut self) {
        while let Some((what, step)) = self.steps.pop() {
            tracing::debug!(step = what, "undoing");
            step();
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
}
