//! A minimal CSI client for `benches/csi.sh`: drives a running `layerfs-csi` over its socket
//! and prints how long the BackingImage work took, in seconds.
//!
//! ```text
//! bench_client SOCKET create-volume NAME BYTES         # prints the volume id
//! bench_client SOCKET publish VOLUME_ID TARGET         # NodePublish as a Block device
//! bench_client SOCKET unpublish VOLUME_ID TARGET
//! bench_client SOCKET snapshot NAME VOLUME_ID          # CreateSnapshot until ready_to_use
//! bench_client SOCKET download IMAGE URL STATE_FILE    # until the image's state says ready
//! ```

use std::path::PathBuf;
use std::time::{Duration, Instant};

use hyper_util::rt::TokioIo;
use layerfs_csi::proto::controller_client::ControllerClient;
use layerfs_csi::proto::node_client::NodeClient;
use layerfs_csi::proto::volume_capability::access_mode::Mode;
use layerfs_csi::proto::volume_capability::{AccessMode, AccessType, BlockVolume};
use layerfs_csi::proto::volume_content_source::{SnapshotSource, Type as SourceType};
use layerfs_csi::proto::*;
use tonic::transport::{Channel, Endpoint, Uri};
use tonic::Code;

type Error = Box<dyn std::error::Error>;

async fn connect(socket: PathBuf) -> Result<Channel, Error> {
    // The authority is arbitrary: the driver serves whatever `:authority` a client sends.
    let channel = Endpoint::try_from("http://[::]:50051")?
        .connect_with_connector(tower::service_fn(move |_: Uri| {
            let socket = socket.clone();
            async move {
                let stream = tokio::net::UnixStream::connect(socket).await?;
                Ok::<_, std::io::Error>(TokioIo::new(stream))
            }
        }))
        .await?;
    Ok(channel)
}

fn block_cap() -> VolumeCapability {
    VolumeCapability {
        access_type: Some(AccessType::Block(BlockVolume {})),
        access_mode: Some(AccessMode {
            mode: Mode::SingleNodeWriter as i32,
        }),
    }
}

fn volume_req(name: &str, bytes: i64, snapshot: Option<&str>) -> CreateVolumeRequest {
    CreateVolumeRequest {
        name: name.into(),
        capacity_range: Some(CapacityRange {
            required_bytes: bytes,
            limit_bytes: 0,
        }),
        volume_capabilities: vec![block_cap()],
        volume_content_source: snapshot.map(|id| VolumeContentSource {
            r#type: Some(SourceType::Snapshot(SnapshotSource {
                snapshot_id: id.into(),
            })),
        }),
        ..Default::default()
    }
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<(), Error> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let usage = "usage: bench_client SOCKET (create-volume NAME BYTES | publish VOLUME_ID TARGET \
                 | unpublish VOLUME_ID TARGET | snapshot NAME VOLUME_ID | download IMAGE URL STATE_FILE)";
    let (socket, command) = match args.as_slice() {
        [socket, command, ..] => (PathBuf::from(socket), command.as_str()),
        _ => return Err(usage.into()),
    };
    let channel = connect(socket).await?;
    let mut ctl = ControllerClient::new(channel.clone());
    let mut node = NodeClient::new(channel);
    match (command, &args[2..]) {
        ("publish", [volume, target]) => {
            node.node_publish_volume(NodePublishVolumeRequest {
                volume_id: volume.clone(),
                target_path: target.clone(),
                volume_capability: Some(block_cap()),
                ..Default::default()
            })
            .await?;
        }
        ("unpublish", [volume, target]) => {
            node.node_unpublish_volume(NodeUnpublishVolumeRequest {
                volume_id: volume.clone(),
                target_path: target.clone(),
            })
            .await?;
        }
        ("create-volume", [name, bytes]) => {
            let volume = ctl
                .create_volume(volume_req(name, bytes.parse()?, None))
                .await?
                .into_inner()
                .volume
                .ok_or("no volume in the answer")?;
            println!("{}", volume.volume_id);
        }
        ("snapshot", [name, volume]) => {
            let req = CreateSnapshotRequest {
                source_volume_id: volume.clone(),
                name: name.clone(),
                parameters: [("type".to_owned(), "bi".to_owned())].into(),
                ..Default::default()
            };
            let started = Instant::now();
            loop {
                match ctl.create_snapshot(req.clone()).await {
                    Ok(r)
                        if r.get_ref()
                            .snapshot
                            .as_ref()
                            .is_some_and(|s| s.ready_to_use) =>
                    {
                        break
                    }
                    Ok(_) => {}
                    Err(s) if s.code() == Code::Aborted => {}
                    Err(s) => return Err(s.into()),
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            println!("{:.3}", started.elapsed().as_secs_f64());
        }
        ("download", [image, url, state_file]) => {
            let handle = format!(
                "bi://backing?backingImage={image}&backingImageDataSourceType=download&url={url}"
            );
            let started = Instant::now();
            // Starts the download; the restore that would follow is not measured.
            match ctl
                .create_volume(volume_req(&format!("pvc-{image}"), 2 << 30, Some(&handle)))
                .await
            {
                Ok(_) => {}
                Err(s) if s.code() == Code::Aborted => {}
                Err(s) => return Err(s.into()),
            }
            let mut seen = false;
            loop {
                match std::fs::read_to_string(state_file) {
                    Ok(text) => {
                        seen = true;
                        let state: serde_json::Value = serde_json::from_str(&text)?;
                        if state["ready"] == true {
                            break;
                        }
                    }
                    // A failed download removes its state.
                    Err(_) if seen => {
                        return Err("the download failed (see the driver's log)".into())
                    }
                    Err(_) => {}
                }
                if started.elapsed() > Duration::from_secs(600) {
                    return Err("the download did not finish in 10 minutes".into());
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            println!("{:.3}", started.elapsed().as_secs_f64());
        }
        _ => return Err(usage.into()),
    }
    Ok(())
}
