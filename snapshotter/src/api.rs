//! containerd's snapshots API, compiled from `proto/` at build time. The modules follow the
//! protobuf packages, as the generated code refers to `containerd.types` by relative path.

#![allow(clippy::all, missing_docs)]

pub mod containerd {
    pub mod types {
        tonic::include_proto!("containerd.types");
    }

    pub mod services {
        pub mod snapshots {
            pub mod v1 {
                tonic::include_proto!("containerd.services.snapshots.v1");
            }
        }
    }
}

pub use containerd::services::snapshots::v1 as snapshots;
pub use containerd::types;
