//! Conformance cases: execution.

instantiate!();
