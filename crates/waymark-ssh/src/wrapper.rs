//! The remote wrapper protocol (work in progress).
