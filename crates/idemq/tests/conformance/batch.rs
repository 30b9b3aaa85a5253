//! Conformance cases: batch.

instantiate!();
