//! The one list of backends, what each cannot do, and the macro that runs
//! every case on each.

/// What a case's setup made, asked whether its backend has a capability
/// (as a case names it after `needs` in [`instantiate!`](crate::instantiate)).
///
/// The answer is the store's own ([`idemq::Queue::supports`]): a backend
/// declares what it cannot do in one place, its `Store::supports`, and a
/// case that needs a capability its backend lacks is skipped with the reason
/// printed instead of failing.
pub trait Supports {
    /// Whether the backend under test has `capability`.
    fn supports(&self, capability: idemq::store::Capability) -> bool;
}

impl Supports for crate::Harness {
    fn supports(&self, capability: idemq::store::Capability) -> bool {
        self.queue.supports(capability)
    }
}

/// Calls `callback!` with the one list of backends.
///
/// `for_each_backend!(path::to::callback!(args…))` expands to
/// `path::to::callback! { [sqlite postgres redis] args… }`. This is the only place
/// the backends are listed: a new backend is one more name here, and every
/// suite built on [`instantiate!`](crate::instantiate) (or on this macro)
/// runs on it.
#[macro_export]
macro_rules! for_each_backend {
    ($($callback:ident)::+ ! ( $($args:tt)* )) => {
        // The one list of backends.
        $($callback)::+! { [sqlite postgres redis] $($args)* }
    };
}

/// Makes one test per listed case and per backend of
/// [`for_each_backend!`](crate::for_each_backend), named
/// `<module>::<backend>::<case>`, each on a tokio runtime with two worker
/// threads (the calling crate depends on `tokio`).
///
/// Each case is an `async fn` of the calling module, taking what the setup
/// expression makes. By default that is a [`Harness`](crate::Harness) on a
/// fresh database of the backend:
///
/// ```text
/// idemq_testkit::instantiate!(
///     replay_returns_original,
///     caller_transactions_commit_with_the_callers_work [needs CallerTransactions],
/// );
/// ```
///
/// A suite whose cases take something else names the setup, an expression
/// over the backend's name (a `&'static str`) evaluated inside the generated
/// `<module>::<backend>` module (so paths start at `crate::` or `super::`);
/// it is awaited only if it says `.await`:
///
/// ```
/// mod harness {
///     /// A backend by name, as the HTTP API tests take it.
///     pub struct Backend(pub &'static str);
/// }
///
/// idemq_testkit::instantiate! {
///     using |backend| crate::harness::Backend(backend);
///     token_required,
/// }
///
/// async fn token_required(b: harness::Backend) {
///     assert!(!b.0.is_empty());
/// }
/// # fn main() {}
/// ```
///
/// `[needs A, B]` after a case names the capabilities it needs (variants of
/// `idemq::store::Capability`): on a backend without one of them (asked
/// through [`Supports`](crate::Supports) of what the setup made) the test
/// prints `skipped: <backend> lacks <capability>` and passes. Nothing else
/// skips: a backend whose server is down fails its cases.
#[macro_export]
macro_rules! instantiate {
    (using |$backend:ident| $setup:expr; $($cases:tt)*) => {
        $crate::for_each_backend!($crate::__instantiate_each!(($backend, $setup) [$($cases)*]));
    };
    ($($cases:tt)*) => {
        $crate::instantiate! {
            using |backend| $crate::Harness::for_backend(backend).await;
            $($cases)*
        }
    };
}

/// [`instantiate!`](crate::instantiate) for each backend in turn (a macro
/// cannot nest two independent repetitions, backends and cases).
#[doc(hidden)]
#[macro_export]
macro_rules! __instantiate_each {
    ([$($name:ident)*] $setup:tt $cases:tt) => {
        $( $crate::__instantiate_backend!($name $setup $cases); )*
    };
}

/// [`instantiate!`](crate::instantiate) for one backend: its module and one
/// test per case.
#[doc(hidden)]
#[macro_export]
macro_rules! __instantiate_backend {
    (
        $name:ident ($backend:ident, $setup:expr)
        [$($case:ident $([needs $($capability:ident),+ $(,)?])?),* $(,)?]
    ) => {
        #[doc = concat!("The cases on the `", stringify!($name), "` backend.")]
        mod $name {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $case() {
                    let $backend: &'static str = stringify!($name);
                    let setup = $setup;
                    $($(
                        if !$crate::Supports::supports(
                            &setup,
                            ::idemq::store::Capability::$capability,
                        ) {
                            println!("skipped: {} lacks {}", $backend, stringify!($capability));
                            return;
                        }
                    )+)?
                    super::$case(setup).await;
                }
            )*
        }
    };
}
