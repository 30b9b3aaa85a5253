//! Conformance cases: operations.

instantiate!();
