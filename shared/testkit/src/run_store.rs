//! A run store in this process, serving its RunService and RunnerService over a real
//! socket, for the tests and benches of the crates that talk to one.

use std::time::Duration;

use runplane_config::Config;
use runplane_grpc::server::ServeError;
use runplane_grpc::{ServiceSet, Stopped};
use runplane_run_store::RunStore;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

/// How long a stopping server lets calls in flight finish.
const GRACE: Duration = Duration::from_secs(1);

/// A run store served on a loopback port of its own, until [`shutdown`] or drop.
///
/// Opened and registered, not started: its rounds (the deadline sweep, the outbox) run
/// only when a test drives them through [`store`], so what they do happens at a step the
/// test chose.
///
/// [`shutdown`]: InProcessRunStore::shutdown
/// [`store`]: InProcessRunStore::store
pub struct InProcessRunStore {
    store: RunStore,
    endpoint: String,
    stop: oneshot::Sender<()>,
    served: JoinHandle<Result<Stopped, ServeError>>,
}

impl InProcessRunStore {
    /// Opens a run store on `config` with the system clock and serves it on a port the
    /// kernel picks.
    pub async fn start(config: &Config) -> Self {
        Self::start_with_clock(config, runplane_clock::SystemClock::shared()).await
    }

    /// [`start`](Self::start) on `clock`.
    pub async fn start_with_clock(config: &Config, clock: runplane_clock::SharedClock) -> Self {
        let store = RunStore::open(config, clock).await.expect("run store");
        let mut services = ServiceSet::new();
        store.register(&mut services);
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind a loopback port");
        let endpoint = format!("http://{}", listener.local_addr().expect("local addr"));
        let (stop, stopped) = oneshot::channel::<()>();
        // Dropping the sender stops the server too, so a dropped fixture leaves no server.
        let served = tokio::spawn(runplane_grpc::serve(
            listener,
            services,
            async {
                let _ = stopped.await;
            },
            GRACE,
        ));
        Self {
            store,
            endpoint,
            stop,
            served,
        }
    }

    /// `http://127.0.0.1:<port>`, for tonic clients.
    pub fn endpoint(&self) -> &str {
        &self.endpoint
    }

    /// The run store being served, for what a test reads or drives directly (its store,
    /// its outbox).
    pub fn store(&self) -> &RunStore {
        &self.store
    }

    /// Stops serving and waits until the server has stopped.
    pub async fn shutdown(self) {
        let _ = self.stop.send(());
        let _ = self.served.await;
    }
}

/// Opens a fresh run store (its own pool, its rounds not started) on `config` and serves it on `addr`, waiting
/// for the address to be free (a restart on the same port); runs until dropped or the
/// server fails.
pub async fn serve_at(config: &Config, addr: &str) {
    let store = RunStore::open(config, runplane_clock::SystemClock::shared())
        .await
        .expect("run store");
    let mut services = ServiceSet::new();
    store.register(&mut services);
    let listener = loop {
        match tokio::net::TcpListener::bind(addr).await {
            Ok(listener) => break listener,
            Err(_) => tokio::time::sleep(Duration::from_millis(10)).await,
        }
    };
    let _ = runplane_grpc::serve(listener, services, std::future::pending(), GRACE).await;
}

/// [`serve_at`] on a runtime of its own: shutting the runtime down
/// (`shutdown_background`) is a crashed process, its listener and every connection
/// closed at once.
pub fn serve_on_own_runtime(config: &Config, addr: String) -> tokio::runtime::Runtime {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .expect("a runtime for the run store");
    let config = config.clone();
    runtime.spawn(async move { serve_at(&config, &addr).await });
    runtime
}
