use std::process::ExitCode;

use anyhow::Context;
use clap::Parser;
use layerfs::cli::{Cli, Command};
use layerfs::daemon::{self, Readiness};
use layerfs::MountConfig;

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Mount(args) => args
            .into_config()
            .map_err(anyhow::Error::from)
            .and_then(mount),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("layerfs: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn mount(mut config: MountConfig) -> anyhow::Result<()> {
    config.validate()?;
    let mut readiness = if config.foreground {
        Readiness::foreground()
    } else {
        daemon::detach().context("detaching the daemon")?
    };
    init_logging(&config);
    let result = layerfs::mount::serve(&config, &mut readiness);
    if let Err(e) = &result {
        readiness.failed(&e.to_string());
        tracing::error!(error = %e, "mount failed");
    }
    Ok(result?)
}

fn init_logging(config: &MountConfig) {
    use tracing_subscriber::EnvFilter;
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt().with_env_filter(filter);
    match (&config.log_file, config.foreground) {
        (Some(path), _) => match std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)
        {
            Ok(file) => builder
                .with_ansi(false)
                .with_writer(std::sync::Mutex::new(file))
                .init(),
            Err(e) => {
                eprintln!(
                    "layerfs: log file {}: {e}; logging to stderr",
                    path.display()
                );
                builder.with_writer(std::io::stderr).init();
            }
        },
        _ => builder.with_writer(std::io::stderr).init(),
    }
}
