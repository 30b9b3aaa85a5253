//! # idemq-server
//!
//! The home of idemq's HTTP API (v1) and operator dashboard, as a library
//! that never touches SQL and calls only `idemq::Queue`.
//!
//! Not built yet: this version of idemq has no HTTP surface. The README's
//! status table says what is available.
