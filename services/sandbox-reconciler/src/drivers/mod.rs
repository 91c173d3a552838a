//! The reconciler's drivers, behind `runplane_sandbox`'s one [`Driver`] trait: `routed`
//! (local sandboxes through the process driver, the rest through their node agents) and
//! a fake whose probes tests script, including changing the database while a probe is in
//! flight.

pub mod fake;
pub mod routed;

pub use fake::FakeDriver;
pub use routed::RoutedDriver;
pub use runplane_sandbox::{Driver, DriverError, Launch, ProcessDriver};
