//! Conformance cases: races between clients on separate connections.

instantiate!();
