//! The reconciler's decisions, without I/O.

pub mod loss;
pub mod placement;
pub mod sandbox;
pub mod status;
pub mod wake;
