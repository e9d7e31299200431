//! Compiles containerd's snapshots API (`proto/`) with a pure-Rust protobuf compiler, so
//! building needs no system `protoc`. The CRI image call (`proto/cri/`) is compiled for
//! the tests, which pull images through containerd's CRI plugin.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let proto = "proto/containerd/services/snapshots/v1/snapshots.proto";
    println!("cargo:rerun-if-changed=proto");
    println!("cargo:rerun-if-changed=build.rs");
    let fds = protox::compile([proto], ["proto"])?;
    tonic_build::configure()
        .build_server(true)
        .build_client(true)
        .compile_fds(fds)?;
    let cri = protox::compile(["proto/cri/runtime.proto"], ["proto"])?;
    tonic_build::configure()
        .build_server(false)
        .build_client(true)
        .compile_fds(cri)?;
    Ok(())
}
