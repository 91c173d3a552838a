//! The reconcile tick and the outbox delivery.
//!
//! A tick reads live sandboxes in bounded batches and probes them with bounded
//! concurrency. It never holds a transaction or lock across a probe; instead every write
//! it makes afterwards is a compare-and-set on what it read (stamp and generation), so
//! overlapping ticks and several reconciler replicas are safe by construction: a tick
//! with a stale snapshot simply loses.
//!
//! The parts: [`tick`] (the loss-grace tick), [`dispatch`] (queued runs to sandboxes),
//! [`ended`] (the sweep of ended runs and the stops it owes), [`wakes`] (parked runs with
//! a message waiting), [`pauses`] (paused runs' sandboxes suspended, resumed ones
//! restored), [`outbox`] (FailRun delivery) and [`round`] (one round of all of
//! them, and the loop that runs it), and [`waiting`] (whether local agents wait for
//! input, told to the run store). [`Reconciler`] is what each of them works with.

pub mod dispatch;
pub mod ended;
pub mod outbox;
pub mod pauses;
mod reconciler;
pub mod round;
mod runs;
pub mod tick;
pub mod waiting;
pub mod wakes;

pub use crate::clients::RunStoreClient;
pub use dispatch::{RunnerEndpoints, dispatch};
pub use ended::{TERMINAL_RUN_STATES, stop_local};
pub use outbox::deliver_outbox;
pub use pauses::RESUME_WAKE_REASON;
pub use reconciler::{ReconcileSettings, Reconciler, TickReport};
pub use round::run_loop;
pub use wakes::MESSAGE_WAKE_REASON;
