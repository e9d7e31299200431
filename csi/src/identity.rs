//! The CSI Identity service: who the plugin is and what it offers.

use std::sync::Arc;

use tonic::{Request, Response, Status};

use super::proto::identity_server::Identity;
use super::proto::plugin_capability::{service, Service, Type};
use super::proto::*;
use super::Driver;

pub struct IdentityService(pub Arc<Driver>);

#[tonic::async_trait]
impl Identity for IdentityService {
    async fn get_plugin_info(
        &self,
        _: Request<GetPluginInfoRequest>,
    ) -> Result<Response<GetPluginInfoResponse>, Status> {
        Ok(Response::new(GetPluginInfoResponse {
            name: self.0.config.driver_name.clone(),
            vendor_version: env!("CARGO_PKG_VERSION").to_owned(),
            manifest: Default::default(),
        }))
    }

    /// The controller service; volumes are reachable only on the node that holds them
    /// (accessibility constraints). Volume expansion is not advertised: in Kubernetes it needs
    /// the csi-resizer sidecar, which cannot run per node (it has no `--node-deployment`
    /// mode), and a central one would call whichever node's driver, not the one holding the
    /// volume. The expansion RPCs stay implemented for COs that route them correctly.
    async fn get_plugin_capabilities(
        &self,
        _: Request<GetPluginCapabilitiesRequest>,
    ) -> Result<Response<GetPluginCapabilitiesResponse>, Status> {
        let service = |t: service::Type| PluginCapability {
            r#type: Some(Type::Service(Service { r#type: t as i32 })),
        };
        Ok(Response::new(GetPluginCapabilitiesResponse {
            capabilities: vec![
                service(service::Type::ControllerService),
                service(service::Type::VolumeAccessibilityConstraints),
            ],
        }))
    }

    async fn probe(&self, _: Request<ProbeRequest>) -> Result<Response<ProbeResponse>, Status> {
        let dirs = [self.0.volumes.root(), self.0.images.store.dir()];
        for dir in dirs {
            if let Err(e) = std::fs::metadata(dir) {
                return Err(Status::failed_precondition(format!(
                    "store {} is not usable: {e}",
                    dir.display()
                )));
            }
        }
        Ok(Response::new(ProbeResponse { ready: Some(true) }))
    }
}
