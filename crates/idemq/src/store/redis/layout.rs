//! The data layout of an installation on Redis: every key starts with the
//! installation's prefix `P` (`?prefix=`, default `idemq:`; it ends in its
//! only colon, so no other installation's prefix starts with it and no key
//! is two installations'). Times are
//! integer microseconds since the Unix epoch (UTC) written as decimal text;
//! a missing hash field is NULL. Nothing expires by Redis key expiry: the
//! maintenance functions sweep what the stored times say is over.
//!
//! Installation:
//! - `P layout`: the data layout version ([`super::LAYOUT`], now 3);
//! - `P version`: the version of the function library the installation was
//!   migrated for (the library is `idemq_<version>`, its functions
//!   `idemq_<version>_<operation>`);
//! - `P revision`: that library's revision ([`super::FUNCTIONS_REVISION`]),
//!   which only grows: an older binary refuses a higher one;
//! - `P idemq`: the idemq version that last migrated the installation;
//! - `P installation` (hash): `key_check`, `created_at`, `updated_at`;
//! - `P seq`: the counter that numbers jobs and events alike;
//! - `P test_clock`: the clock of record of stores opened with the test
//!   clock option (ignored by every other store).
//!
//! Jobs:
//! - `P job:<id>` (hash): the fields of a SQLite job row (`id`, `type`,
//!   `queue`, `state` = `waiting` | `active` | `completed` | `dead` |
//!   `cancelled`, `payload`, `result`, `priority`, `run_at`, `attempt`,
//!   `attempts_used`, `max_attempts`, `retry` (JSON), `timeout_ms`,
//!   `deadline`, `concurrency_key`, `tags` (JSON), `keep_ms`, `fingerprint`
//!   (the 13 packed field digests, hex), `idem_scope`, `idem_key_hash`
//!   (hex), `idem_key_preview`, `dedupe_key`, `dedupe_mode`, `created_at`,
//!   `updated_at`, `finished_at`, `purge_after`, `last_error`,
//!   `cancel_requested` (`1`), `lease_token`, `lease_expires_at`,
//!   `lease_ms`, `worker`, `started_at`, `seq`, `first_run_at`, `claim_seq`,
//!   `done_seq`);
//! - `P qj:<queue>` (zset seq → id): the jobs of a queue in listing order,
//!   newest first; the cursor is the seq. A listing of every job merges the
//!   queues' (layout 1 also kept `P jobs`, every job);
//! - `P st:<state>` (zset seq → id): the jobs of a stored state;
//! - `P cnt:<queue>` (hash `active` | `completed` | `dead` | `cancelled` →
//!   count): kept by every transition, in the function that makes it; the
//!   waiting count is the sum of the queue's lane counts (`wl:`; layout 1
//!   also kept it here);
//! - `P queues` (set): queue names that ever had a job (added by the
//!   enqueue that makes a lane's count 1: a queue not in it has no job);
//!   `P paused` (hash queue → `1` | `0`);
//! - `P w:<queue>|<priority>|<type>` (zset run_at → `%016d` seq ‖ id): the
//!   waiting jobs (scheduled and ready) of one claim lane, due ones first;
//!   `P wl:<queue>` (hash `<priority>|<type>` → count of its waiting jobs)
//!   lists the lanes, a lane without jobs has no field;
//! - `P leases` (zset lease expiry → id): active jobs; `P ck:<key>` → the
//!   id of the active job holding a concurrency key;
//! - parked jobs (layout 3): a due waiting job a claim met while its
//!   concurrency key was held leaves its lane for
//!   `P ckw:<key>|<queue>|<priority>|<type>` (zset run_at → its lane
//!   member), counted in `P ckwl:<key>` (hash `<queue>|<priority>|<type>`
//!   → count), the key in `P ckp` (set), its hash marked `parked` (`1`);
//!   it still counts in its lane's `wl:` count. When the key frees, the
//!   first parked job of each of the key's lanes returns to its lane;
//! - `P purge` (zset purge_after → id): terminal jobs by retention;
//! - `P dk:<type>|<dedupe key>` (set): pending jobs with that dedupe key.
//!
//! History:
//! - `P ev:<id>` (list of `<seq> <at> <kind> <JSON data>`): the stored
//!   events; `accepted`, the current attempt's `claimed` and `completed`
//!   are derived from the job hash (as on SQLite); a `run_at` in the data is
//!   kept as integer µs and read back as an instant;
//! - `P runs:<id>` (list of JSON objects): the attempts that ended other
//!   than completed; the current or completed one is derived;
//! - `P cp:<id>` (hash name → JSON): checkpoints.
//!
//! Bindings:
//! - `P idem:<scope>|<hash hex>` (hash `job`, `fp`, `preview`, `created`,
//!   `expires`); `P idemexp` (zset expires → `<scope>|<hash hex>`);
//!   `P jk:<id>` (set): the bindings bound to a job now (a binding taken
//!   by another job leaves it), deleted with the job (a purged job's
//!   bindings live out their ttl without it);
//! - `P dd:<type>|<key>` (hash `job`, `mode`, `ttl`, `mw`, `acc`, `wu`);
//!   `P ddexp` (zset: window end, or the instant a window-less binding's
//!   job ended → `<type>|<key>`).
//!
//! Schedules: `P sch:<name>` (hash of the SQLite columns), `P schedules`
//! (set of names), `P schdue` (zset next fire → name).
//!
//! Wake-ups: `PUBLISH P wake <queue>`, once per queue per function call.
