//! Compiles the CSI protocol (`proto/csi.proto`) into Rust with a pure-Rust protobuf
//! compiler, so building needs no system `protoc`.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let proto_dir = "proto";
    let proto = "proto/csi.proto";
    println!("cargo:rerun-if-changed={proto}");
    println!("cargo:rerun-if-changed=build.rs");
    let fds = protox::compile([proto], [proto_dir])?;
    tonic_build::configure()
        .build_server(true)
        .build_client(true)
        .compile_fds(fds)?;
    Ok(())
}
