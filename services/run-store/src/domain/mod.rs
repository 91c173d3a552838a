//! The run store's decisions and encodings, without I/O.

pub mod chain;
pub mod ids;
pub mod labels;
pub mod limits;
pub mod receipt;
pub mod retry;
pub mod share;
pub mod state;
pub mod validate;
pub mod verdict;
pub mod webhook;
