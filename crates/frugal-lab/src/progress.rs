//! What a long study tells its caller as it goes. The studies run for minutes to hours and
//! nothing in this crate prints, so each takes a callback; the CLI writes these to stderr.

use frugal_train::trainer::Event;

/// One report from a study in progress.
pub enum Progress<'e> {
    /// A stage begun or a result, one line in words.
    Line(String),
    /// A step counter: the same line rewritten in place until the next [`Progress::Line`].
    Status(String),
    /// A training run's step or held-out evaluation; the run has `steps` steps in all.
    Train { steps: usize, event: Event<'e> },
}

/// The callback every study takes.
pub type OnProgress<'a> = &'a mut dyn FnMut(Progress<'_>);

/// Forwards a training run's events to `on` (for [`crate::heal`]'s `on_event`).
pub fn training<'a>(
    on: &'a mut dyn FnMut(Progress<'_>),
    steps: usize,
) -> impl FnMut(Event<'_>) + 'a {
    move |event| on(Progress::Train { steps, event })
}
