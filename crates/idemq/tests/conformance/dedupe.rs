//! Conformance cases: dedupe.

instantiate!();
