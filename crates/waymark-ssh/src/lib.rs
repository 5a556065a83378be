//! Waymark's SSH executor (work in progress).
pub mod wrapper;
