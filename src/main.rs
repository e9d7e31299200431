use std::process::ExitCode;

use anyhow::Context;
use clap::error::ErrorKind;
use clap::Parser;
use layerfs::cli::{Cli, Command};
use layerfs::daemon::{self, Readiness};
use layerfs::MountConfig;

fn main() -> ExitCode {
    let cli = match parse_cli() {
        Ok(cli) => cli,
        Err(code) => return code,
    };
    let result = match cli.command {
        Command::Mount(args) => args
            .into_config()
            .map_err(anyhow::Error::from)
            .and_then(mount),
        Command::Csi(args) => csi(args.into_config()),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("layerfs: {e:#}");
            ExitCode::FAILURE
        }
    }
}

/// Parses the command line. Usage errors come out as one line naming the culprit, like the
/// errors found later; `--help` and `--version` print and exit as usual.
fn parse_cli() -> Result<Cli, ExitCode> {
    match Cli::try_parse() {
        Ok(cli) => Ok(cli),
        Err(e)
            if !e.use_stderr()
                || e.kind() == ErrorKind::DisplayHelpOnMissingArgumentOrSubcommand =>
        {
            e.exit()
        }
        Err(e) => {
            eprintln!("layerfs: {}", one_line(&e.render().to_string()));
            Err(ExitCode::from(2))
        }
    }
}

/// clap explains an error in paragraphs (the problem with its details, a tip, the usage);
/// keeps the first on one line.
fn one_line(text: &str) -> String {
    let first = text.split("\n\n").next().unwrap_or(text);
    let line = first.split_whitespace().collect::<Vec<_>>().join(" ");
    match line.strip_prefix("error: ") {
        Some(rest) => rest.to_owned(),
        None => line,
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

fn csi(config: layerfs::csi::Config) -> anyhow::Result<()> {
    use tracing_subscriber::EnvFilter;
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .init();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    Ok(runtime.block_on(layerfs::csi::serve(config))?)
}

fn init_logging(config: &MountConfig) {
    use tracing_subscriber::EnvFilter;
    // A detached daemon without a log file keeps the terminal it returns to quiet: until
    // it is ready only warnings reach stderr, and after that stderr is /dev/null.
    let default = if config.foreground || config.log_file.is_some() {
        "info"
    } else {
        "warn"
    };
    // fuser warns that its own unmount-on-drop failed after every external umount: the
    // filesystem is already gone then, so that line says nothing.
    let filter = EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| EnvFilter::new(format!("{default},fuser::session=error")));
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
