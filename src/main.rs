use std::process::ExitCode;

use anyhow::Context;
use clap::error::ErrorKind;
use clap::Parser;
use layerfs::cli::{Cli, Command, ControlArgs, PublishArgs, PublishCommand, QuotaCommand};
use layerfs::control::{Op, QuotaSet, Reply};
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
        Command::Status(args) => control(Op::Status, args),
        Command::Refresh(args) => refresh(args),
        Command::Layers(args) => control(Op::Layers, args),
        Command::Images(args) => control(Op::Images, args),
        Command::Umount(args) => layerfs::control::umount::umount(
            &args.mountpoint,
            std::time::Duration::from_secs(args.wait),
        )
        .map(drop)
        .map_err(anyhow::Error::from),
        Command::Quota(args) => quota(args.command),
        Command::Publish(args) => publish(args),
        Command::Upgrade(args) => {
            layerfs::control::upgrade(&args.mountpoint, std::time::Duration::from_secs(args.wait))
                .map_err(anyhow::Error::from)
                .and_then(print)
        }
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

fn mount(config: MountConfig) -> anyhow::Result<()> {
    Ok(layerfs::launch::mount(config, 1)?)
}

/// `layerfs status|refresh|layers|images`: prints the mount's answer.
fn control(op: Op, args: ControlArgs) -> anyhow::Result<()> {
    print(layerfs::control::command(&args.mountpoint, op, args.json)?)
}

/// `layerfs refresh [--accept-empty]`.
fn refresh(args: layerfs::cli::RefreshArgs) -> anyhow::Result<()> {
    let reply = layerfs::control::refresh(
        &args.control.mountpoint,
        args.accept_empty,
        args.control.json,
    )?;
    print(reply)
}

/// `layerfs publish image SOURCE IMAGE --remote REMOTE`: copies, then says what it did.
fn publish_image(args: layerfs::cli::PublishImageArgs) -> anyhow::Result<()> {
    use layerfs::publish::image::{publish_image, Options};
    let options = Options {
        driver: args.driver,
        ..Options::default()
    };
    let done = publish_image(&args.source, &args.image, &args.remote, &options)?;
    for layer in &done.layers {
        let what = match (layer.copied, layer.remote_id == layer.id) {
            (true, _) => "copied".to_owned(),
            (false, true) => "skipped (already present)".to_owned(),
            (false, false) => format!("skipped (already present as {})", layer.remote_id),
        };
        println!("layer {}: {what}", layer.id);
    }
    let names = if done.names.is_empty() {
        String::new()
    } else {
        format!(" ({})", done.names.join(", "))
    };
    let what = if done.image_copied {
        "copied"
    } else {
        "skipped (already present)"
    };
    println!("image {}{names}: {what}", done.image);
    let copied = done.layers.iter().filter(|l| l.copied).count();
    println!(
        "{copied} of {} layers copied, image {}",
        done.layers.len(),
        if done.image_copied {
            "copied"
        } else {
            "already present"
        }
    );
    Ok(())
}

/// `layerfs quota set|get|list|clear`.
fn quota(command: QuotaCommand) -> anyhow::Result<()> {
    use layerfs::control;
    let reply = match command {
        QuotaCommand::Set(args) => {
            let set = QuotaSet {
                path: args.path.clone(),
                storage: args.storage(),
                inodes: args.inodes,
                labels: args.labels.clone(),
                create: args.create,
            };
            control::quota_set(&args.mountpoint, &set, args.json)?
        }
        QuotaCommand::Get(args) => {
            control::quota(&args.mountpoint, Op::QuotaGet, Some(&args.path), args.json)?
        }
        QuotaCommand::List(args) => {
            control::quota(&args.mountpoint, Op::QuotaList, None, args.json)?
        }
        QuotaCommand::Clear(args) => control::quota(
            &args.mountpoint,
            Op::QuotaClear,
            Some(&args.path),
            args.json,
        )?,
    };
    print(reply)
}

/// `layerfs publish --watch REMOTE | image ...`.
fn publish(args: PublishArgs) -> anyhow::Result<()> {
    match (args.watch, args.command) {
        (Some(remote), None) => {
            let mut options = layerfs::publish::watch::WatchOptions::new(&remote);
            options.name = args.name;
            options.driver = args.driver;
            options.interval = std::time::Duration::from_secs(args.interval.max(1));
            publish_watch(&options)
        }
        (None, Some(PublishCommand::Image(image))) => publish_image(image),
        _ => anyhow::bail!(
            "publish needs --watch REMOTE or a subcommand: `layerfs publish --watch REMOTE` \
             or `layerfs publish image SOURCE IMAGE --remote REMOTE`"
        ),
    }
}

/// Runs the publisher in the foreground until SIGTERM, SIGINT or SIGHUP.
fn publish_watch(options: &layerfs::publish::watch::WatchOptions) -> anyhow::Result<()> {
    use signal_hook::consts::{SIGHUP, SIGINT, SIGTERM};
    layerfs::logging::init_stderr("info");
    let (stop_tx, stop_rx) = crossbeam_channel::bounded::<()>(1);
    let mut signals = signal_hook::iterator::Signals::new([SIGTERM, SIGINT, SIGHUP])
        .context("installing signal handlers")?;
    std::thread::spawn(move || {
        if signals.forever().next().is_some() {
            let _ = stop_tx.send(());
        }
    });
    layerfs::publish::watch::watch(options, stop_rx)
        .with_context(|| format!("publishing from {}", options.remote.display()))
}

/// Prints a control command's answer, and its note on stderr.
fn print(reply: Reply) -> anyhow::Result<()> {
    use std::io::Write;
    if let Some(note) = &reply.note {
        eprintln!("layerfs: {note}");
    }
    std::io::stdout()
        .lock()
        .write_all(reply.text.as_bytes())
        .context("writing the answer")?;
    Ok(reply.outcome?)
}
