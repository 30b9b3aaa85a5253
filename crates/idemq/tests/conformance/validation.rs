//! Conformance cases: validation.

instantiate!();
