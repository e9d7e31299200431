//! Quotas on read-write directories of the view (DESIGN §6), after containerd's universal
//! snapshot-quota design.
//!
//! - [`size`]: the size strings users and containerd labels give.
//! - [`storage`]: the one place that decides what happens to a `storage {size,
//!   ignore_failed}` request, over snapshotter backends that do or do not support quotas.
//! - [`table`]: the live quota roots of a mount, their limits and usage, and the
//!   reservations writes take against them.
//! - [`io`]: what calls on file data may allocate, estimated before they run.
//! - [`scan`]: usage recomputed from local at mount (and when a quota is set), so that a
//!   crash never leaves it wrong.
//! - [`roots`]: the registry of roots saved and loaded, and the errors of changing roots.
//! - [`persist`]: the registry of quota roots kept in local.
//!
//! Usage is allocated space (`st_blocks`), so sparse holes are free until written, as with
//! XFS project quotas. Quota roots do not nest: a quota cannot be set inside, or above,
//! another quota root.

pub mod io;
pub mod persist;
pub mod roots;
pub mod scan;
pub mod size;
pub mod storage;
pub mod table;
