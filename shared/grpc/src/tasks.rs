//! Background work, declared.
//!
//! Every loop a service runs beside its handlers is started through [`Tasks::spawn`] with
//! a [`Task`] that names it and says two things:
//!
//! - what cancellation means ([`OnCancel`]): the task is told and returns between rounds
//!   ([`OnCancel::Finish`]), or it is aborted where it stands, because whatever it was
//!   doing is redone by the next start or by another replica ([`OnCancel::Abort`]);
//! - what a panic means ([`OnPanic`]): it is logged and the task starts again after a
//!   pause ([`OnPanic::Restart`]), or it is logged and the process stops
//!   ([`OnPanic::Stop`]), because the service is not whole without it and a fresh process
//!   is the recovery that is known to work. Such a task ending on its own stops the
//!   process too.
//!
//! Helpers that live and die with one owner (a long poll beside a loop, a relay beside a
//! store) are held by an [`AbortOnDrop`] instead. Not declared yet: the Postgres
//! `LISTEN/NOTIFY` relays (`runplane_db::notify`) and the run store's append-group
//! writer are spawned by their owners; a panic there costs wake-ups until the 30 s
//! re-check, not data.
//!
//! Handles are kept. [`Tasks::shutdown`] cancels every task and awaits it within the grace
//! it is given; a task that outlives the grace is aborted and named in the log.
//! [`crate::serve`] does that for every group a [`crate::ServiceSet`] was given, within
//! the shutdown grace, and stops serving (returning [`crate::server::ServeError::Task`])
//! when a [`OnPanic::Stop`] task panics.

use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::watch;
use tokio::task::JoinHandle;

/// The first pause before a panicked [`OnPanic::Restart`] task starts again; each further
/// panic doubles it, up to [`RESTART_PAUSE_MAX`].
pub const RESTART_PAUSE: Duration = Duration::from_secs(1);
pub const RESTART_PAUSE_MAX: Duration = Duration::from_secs(30);

/// What cancellation means to a task.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OnCancel {
    /// The task watches its [`Cancelled`] and returns once its current round is done.
    Finish,
    /// The task is aborted where it stands: its work is redone by the next start.
    Abort,
}

/// What a panic means to a task.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OnPanic {
    /// Logged; the task starts again after [`RESTART_PAUSE`] (doubling per panic).
    Restart,
    /// Logged; the process stops serving, so its supervisor starts a fresh one.
    Stop,
}

/// A background task's declaration.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Task {
    /// Stable and dotted, `<service>.<what>`: it is the `task` field of every log line.
    pub name: &'static str,
    pub on_cancel: OnCancel,
    pub on_panic: OnPanic,
}

/// Tells a task that it should stop.
#[derive(Debug, Clone)]
pub struct Cancelled(watch::Receiver<bool>);

impl Cancelled {
    pub fn is_cancelled(&self) -> bool {
        *self.0.borrow()
    }

    /// Resolves once the task is cancelled. A group that is dropped without a shutdown
    /// never cancels its tasks: they run as long as the runtime does.
    pub async fn cancelled(mut self) {
        if self.0.wait_for(|cancelled| *cancelled).await.is_err() {
            std::future::pending::<()>().await;
        }
    }
}

/// A started task's name and its supervisor.
type Running = (&'static str, JoinHandle<()>);

/// A group of declared background tasks (cheap to clone; clones share the group).
#[derive(Clone)]
pub struct Tasks {
    cancel: Arc<watch::Sender<bool>>,
    failed: Arc<watch::Sender<Option<&'static str>>>,
    running: Arc<Mutex<Vec<Running>>>,
}

impl Default for Tasks {
    fn default() -> Self {
        Self::new()
    }
}

impl std::fmt::Debug for Tasks {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let running = self.running.lock().expect("tasks lock");
        f.debug_struct("Tasks")
            .field(
                "running",
                &running.iter().map(|(n, _)| *n).collect::<Vec<_>>(),
            )
            .finish()
    }
}

impl Tasks {
    pub fn new() -> Self {
        Self {
            cancel: Arc::new(watch::channel(false).0),
            failed: Arc::new(watch::channel(None).0),
            running: Arc::default(),
        }
    }

    /// Starts `task`: `body` is called with the task's [`Cancelled`] and awaited, and
    /// called again after a panic when the task restarts. After [`Tasks::shutdown`] has
    /// begun nothing new starts. A task that stops the process when it panics stops it
    /// too when it ends on its own before it was cancelled: it was not meant to end.
    pub fn spawn<F, Fut>(&self, task: Task, body: F)
    where
        F: Fn(Cancelled) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = ()> + Send + 'static,
    {
        // Under the lock that `shutdown` takes the handles with: a task either starts
        // before and is awaited, or sees the cancellation and does not start.
        let mut running = self.running.lock().expect("tasks lock");
        if *self.cancel.borrow() {
            tracing::debug!(task = task.name, "not started: shutting down");
            return;
        }
        let cancelled = Cancelled(self.cancel.subscribe());
        let failed = self.failed.clone();
        let supervisor = tokio::spawn(supervise(task, Arc::new(body), cancelled, failed));
        running.retain(|(_, handle)| !handle.is_finished());
        running.push((task.name, supervisor));
    }

    /// Resolves with the name of the first [`OnPanic::Stop`] task that panicked.
    pub async fn failed(&self) -> &'static str {
        let mut failed = self.failed.subscribe();
        let name = failed.wait_for(Option::is_some).await.map(|name| *name);
        match name {
            Ok(name) => name.unwrap_or_default(),
            Err(_) => std::future::pending().await,
        }
    }

    /// Cancels every task without waiting for them: finishing tasks end their round in
    /// the background, aborting ones are dropped. For an owner that cannot wait (a drop).
    pub fn cancel(&self) {
        self.cancel.send_replace(true);
    }

    /// Cancels every task and waits for them until `deadline`; tasks still running then
    /// are aborted. Returns the names of those aborted at the deadline.
    pub async fn shutdown(&self, deadline: tokio::time::Instant) -> Vec<&'static str> {
        self.cancel.send_replace(true);
        let running = std::mem::take(&mut *self.running.lock().expect("tasks lock"));
        let mut outlived = Vec::new();
        for (name, mut handle) in running {
            if tokio::time::timeout_at(deadline, &mut handle)
                .await
                .is_err()
            {
                tracing::warn!(
                    task = name,
                    "background task outlived the shutdown grace; aborted"
                );
                handle.abort();
                outlived.push(name);
            }
        }
        outlived
    }
}

async fn supervise<F, Fut>(
    task: Task,
    body: Arc<F>,
    cancelled: Cancelled,
    failed: Arc<watch::Sender<Option<&'static str>>>,
) where
    F: Fn(Cancelled) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = ()> + Send + 'static,
{
    let mut pause = RESTART_PAUSE;
    loop {
        // `body` is called inside the spawned task, so a panic while it builds its future
        // is the task's panic, not the supervisor's.
        let mut run = AbortOnDrop(tokio::spawn({
            let (body, cancelled) = (body.clone(), cancelled.clone());
            async move { body(cancelled).await }
        }));
        let joined = match task.on_cancel {
            OnCancel::Finish => (&mut run.0).await,
            OnCancel::Abort => tokio::select! {
                joined = &mut run.0 => joined,
                // Dropping `run` aborts the body.
                () = cancelled.clone().cancelled() => return,
            },
        };
        let panic = match joined {
            Ok(()) if cancelled.is_cancelled() => return,
            Ok(()) if task.on_panic == OnPanic::Stop => {
                tracing::error!(
                    task = task.name,
                    "background task ended on its own; the process stops"
                );
                fail(&failed, task.name);
                return;
            }
            Ok(()) => {
                tracing::warn!(task = task.name, "background task ended on its own");
                return;
            }
            Err(e) if e.is_panic() => panic_message(e.into_panic()),
            // Aborted: only a shutdown past its grace aborts a body.
            Err(_) => return,
        };
        match task.on_panic {
            OnPanic::Stop => {
                tracing::error!(task = task.name, panic = %panic, "background task panicked; the process stops");
                fail(&failed, task.name);
                return;
            }
            OnPanic::Restart => {
                tracing::error!(
                    task = task.name,
                    panic = %panic,
                    restart_in_ms = pause.as_millis() as u64,
                    "background task panicked; it starts again"
                );
                tokio::select! {
                    () = tokio::time::sleep(pause) => {}
                    () = cancelled.clone().cancelled() => return,
                }
                pause = (pause * 2).min(RESTART_PAUSE_MAX);
            }
        }
    }
}

/// Records `name` as the group's failure, unless another task failed it first.
fn fail(failed: &watch::Sender<Option<&'static str>>, name: &'static str) {
    failed.send_if_modified(|first| {
        let is_first = first.is_none();
        if is_first {
            *first = Some(name);
        }
        is_first
    });
}

fn panic_message(panic: Box<dyn std::any::Any + Send>) -> String {
    match panic.downcast::<String>() {
        Ok(message) => *message,
        Err(panic) => match panic.downcast::<&'static str>() {
            Ok(message) => (*message).to_owned(),
            Err(_) => "a panic without a message".to_owned(),
        },
    }
}

/// A task handle that aborts its task when dropped: for helper tasks whose owner's end
/// is their end.
#[derive(Debug)]
pub struct AbortOnDrop<T>(pub JoinHandle<T>);

impl<T> Drop for AbortOnDrop<T> {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// A task group that is cancelled (without waiting) when dropped: for a group whose
/// owner's end is its end, where nothing awaits a shutdown.
#[derive(Debug)]
pub struct CancelOnDrop(pub Tasks);

impl Drop for CancelOnDrop {
    fn drop(&mut self) {
        self.0.cancel();
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicU32, Ordering};

    use tokio::time::Instant;

    use super::*;

    fn task(on_cancel: OnCancel, on_panic: OnPanic) -> Task {
        Task {
            name: "test.task",
            on_cancel,
            on_panic,
        }
    }

    /// A restarting task that panics is started again after the pause, and again after
    /// twice the pause; the group is not failed.
    #[tokio::test(start_paused = true)]
    async fn a_restarting_task_starts_again_after_each_panic() {
        let tasks = Tasks::new();
        let starts = Arc::new(AtomicU32::new(0));
        tasks.spawn(task(OnCancel::Finish, OnPanic::Restart), {
            let starts = starts.clone();
            move |cancelled| {
                let n = starts.fetch_add(1, Ordering::SeqCst);
                async move {
                    if n < 2 {
                        panic!("round {n} failed");
                    }
                    cancelled.cancelled().await;
                }
            }
        });
        tokio::time::sleep(RESTART_PAUSE / 2).await;
        assert_eq!(
            starts.load(Ordering::SeqCst),
            1,
            "restarted before the pause"
        );
        tokio::time::sleep(RESTART_PAUSE).await;
        assert_eq!(
            starts.load(Ordering::SeqCst),
            2,
            "not restarted after the pause"
        );
        tokio::time::sleep(RESTART_PAUSE * 2).await;
        assert_eq!(starts.load(Ordering::SeqCst), 3, "the pause did not double");
        let failed = tokio::time::timeout(Duration::from_secs(60), tasks.failed()).await;
        assert!(failed.is_err(), "a restarting task failed the group");
        let outlived = tasks
            .shutdown(Instant::now() + Duration::from_secs(1))
            .await;
        assert!(outlived.is_empty(), "{outlived:?}");
    }

    /// An owner that cannot wait cancels without waiting: a finishing task still ends its
    /// round and returns on its own.
    #[tokio::test(start_paused = true)]
    async fn cancel_without_waiting_lets_a_finishing_task_return() {
        let tasks = Tasks::new();
        let (done_tx, done_rx) = tokio::sync::oneshot::channel();
        let done_tx = std::sync::Mutex::new(Some(done_tx));
        tasks.spawn(task(OnCancel::Finish, OnPanic::Restart), move |cancelled| {
            let done = done_tx.lock().unwrap().take();
            async move {
                cancelled.cancelled().await;
                if let Some(done) = done {
                    let _ = done.send(());
                }
            }
        });
        tokio::task::yield_now().await;
        tasks.cancel();
        tokio::time::timeout(Duration::from_secs(1), done_rx)
            .await
            .expect("the task did not see its cancellation")
            .unwrap();
    }

    /// A task that stops the process when it panics also stops it when it returns before
    /// it was cancelled (a server that stopped serving); a restarting one only warns.
    #[tokio::test(start_paused = true)]
    async fn a_stopping_task_that_ends_on_its_own_fails_the_group() {
        let tasks = Tasks::new();
        tasks.spawn(task(OnCancel::Finish, OnPanic::Restart), |_| async {});
        tokio::task::yield_now().await;
        let failed = tokio::time::timeout(Duration::from_secs(1), tasks.failed()).await;
        assert!(
            failed.is_err(),
            "a restarting task that ended failed the group"
        );
        tasks.spawn(task(OnCancel::Finish, OnPanic::Stop), |_| async {});
        assert_eq!(tasks.failed().await, "test.task");
    }

    /// A panic while the body builds its future is the task's panic: it restarts.
    #[tokio::test(start_paused = true)]
    async fn a_panic_before_the_first_await_is_the_tasks_own() {
        let tasks = Tasks::new();
        let starts = Arc::new(AtomicU32::new(0));
        tasks.spawn(task(OnCancel::Finish, OnPanic::Restart), {
            let starts = starts.clone();
            move |cancelled| {
                if starts.fetch_add(1, Ordering::SeqCst) == 0 {
                    panic!("could not build the first round");
                }
                cancelled.cancelled()
            }
        });
        tokio::time::sleep(RESTART_PAUSE * 2).await;
        assert_eq!(starts.load(Ordering::SeqCst), 2, "not restarted");
    }

    /// A task whose panic stops the process fails the group with its name, once.
    #[tokio::test(start_paused = true)]
    async fn a_stopping_task_fails_the_group_with_its_name() {
        let tasks = Tasks::new();
        let starts = Arc::new(AtomicU32::new(0));
        tasks.spawn(task(OnCancel::Finish, OnPanic::Stop), {
            let starts = starts.clone();
            move |_| {
                starts.fetch_add(1, Ordering::SeqCst);
                async { panic!("the loop cannot go on") }
            }
        });
        assert_eq!(tasks.failed().await, "test.task");
        tokio::time::sleep(RESTART_PAUSE_MAX * 2).await;
        assert_eq!(
            starts.load(Ordering::SeqCst),
            1,
            "a stopping task restarted"
        );
    }

    /// At shutdown a finishing task completes the round it is in and returns; an aborting
    /// task is dropped where it stands; one that ignores its cancellation is aborted at the
    /// deadline and named.
    #[tokio::test(start_paused = true)]
    async fn shutdown_finishes_aborts_and_names_what_outlives_the_grace() {
        let tasks = Tasks::new();
        let finished_round = Arc::new(AtomicU32::new(0));
        tasks.spawn(task(OnCancel::Finish, OnPanic::Restart), {
            let finished_round = finished_round.clone();
            move |cancelled| {
                let finished_round = finished_round.clone();
                async move {
                    cancelled.clone().cancelled().await;
                    // The round in hand still completes.
                    tokio::time::sleep(Duration::from_millis(200)).await;
                    finished_round.fetch_add(1, Ordering::SeqCst);
                }
            }
        });
        let aborted_past_cancel = Arc::new(AtomicU32::new(0));
        tasks.spawn(task(OnCancel::Abort, OnPanic::Restart), {
            let reached = aborted_past_cancel.clone();
            move |_| {
                let reached = reached.clone();
                async move {
                    tokio::time::sleep(Duration::from_secs(3600)).await;
                    reached.fetch_add(1, Ordering::SeqCst);
                }
            }
        });
        tasks.spawn(
            Task {
                name: "test.stubborn",
                on_cancel: OnCancel::Finish,
                on_panic: OnPanic::Restart,
            },
            |_| std::future::pending(),
        );
        tokio::task::yield_now().await;
        let started = Instant::now();
        let outlived = tasks.shutdown(started + Duration::from_secs(5)).await;
        assert_eq!(outlived, vec!["test.stubborn"]);
        assert_eq!(
            finished_round.load(Ordering::SeqCst),
            1,
            "the round was cut short"
        );
        assert_eq!(aborted_past_cancel.load(Ordering::SeqCst), 0);
        assert_eq!(started.elapsed(), Duration::from_secs(5));

        // Nothing starts once the group has shut down.
        let starts = Arc::new(AtomicU32::new(0));
        tasks.spawn(task(OnCancel::Finish, OnPanic::Restart), {
            let starts = starts.clone();
            move |_| {
                starts.fetch_add(1, Ordering::SeqCst);
                async {}
            }
        });
        tokio::task::yield_now().await;
        assert_eq!(starts.load(Ordering::SeqCst), 0);
    }
}
