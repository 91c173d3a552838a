//! The host side of a sandbox, shared by the sandbox reconciler (its local sandboxes)
//! and the node agents (everyone else's):
//!
//! - [`container`]: agents in containers of an image through the Docker Engine API,
//!   with the process driver's runner on the host;
//! - [`contract`]: the runner<->sandbox contract, the one place its environment names,
//!   files and formats are spelled; the runner imports it too;
//! - [`driver`]: the [`Driver`] trait, the [`SandboxSpec`] a driver is given, [`Launch`]
//!   and [`Probe`];
//! - [`process`]: the process driver, its containment under bubblewrap, the sandbox's
//!   environment and the reading of `/proc` that tells an agent waiting for input;
//! - [`route_token`]: the signed tokens by which a node's session endpoint knows a
//!   session the reconciler routed to it.
//!
//! Nothing here touches a database: a node agent depends on this crate and on no store.

pub mod container;
pub mod contract;
pub mod driver;
pub mod process;
pub mod route_token;

pub use driver::{Driver, DriverError, Launch, Probe, SandboxSpec};
pub use process::{Containment, ProcessDriver};
