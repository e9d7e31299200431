//! mount(8)'s calling convention for external helpers:
//! `mount.layerfs SOURCE MOUNTPOINT [-sfnv] [-N NAMESPACE] [-o OPTIONS] [-t TYPE]`.

use std::path::PathBuf;

#[derive(Debug, Default, PartialEq, Eq)]
pub struct Args {
    pub source: PathBuf,
    pub mountpoint: PathBuf,
    /// The options meant for layerfs, in order.
    pub options: Vec<String>,
    /// `-s`: ignore options layerfs does not know instead of failing.
    pub sloppy: bool,
    /// `-f`: check everything, mount nothing.
    pub fake: bool,
    pub verbose: bool,
    /// `-N`: the mount namespace to mount in (a path or a pid).
    pub namespace: Option<String>,
    /// `-t`: `layerfs` or `fuse.layerfs`.
    pub fstype: Option<String>,
}

/// What the helper was asked to do.
#[derive(Debug, PartialEq, Eq)]
pub enum Call {
    Mount(Args),
    /// `--help` or `-h`: the usage and every mount option.
    Help,
    /// `--version` or `-V`.
    Version,
}

/// `mount.layerfs --help`: mount(8) never passes it; a person does.
pub fn help() -> String {
    format!(
        "{USAGE}\n\n\
         Mounts layerfs: the read-only layer tree REMOTE under a local read-write layer, at\n\
         MOUNTPOINT. mount(8) runs it for `mount -t layerfs` and /etc/fstab lines of type layerfs.\n\n\
         flags (as mount(8) passes them):\n\
         \x20 -o OPTIONS   comma-separated mount options (below); mount(8)'s own, such as\n\
         \x20              defaults, nofail, _netdev or x-systemd.*, are ignored\n\
         \x20 -s           ignore options layerfs does not know instead of failing\n\
         \x20 -f           check everything, mount nothing\n\
         \x20 -n           accepted (layerfs writes no /etc/mtab)\n\
         \x20 -v           say what is mounted\n\
         \x20 -N NS        mount in another mount namespace (a path or a pid)\n\
         \x20 -t TYPE      layerfs or fuse.layerfs\n\
         \x20 -o remount,… change a running mount's options that can change live\n\n\
         {}\n\
         Exit status: 0 when mounted, 32 when mounting failed (the reason is on stderr).",
        layerfs::config::options::help().trim_end()
    )
}

const USAGE: &str =
    "usage: mount.layerfs REMOTE MOUNTPOINT [-sfnv] [-N NAMESPACE] [-o OPTIONS] [-t TYPE]";

pub fn parse_call(argv: &[String]) -> Result<Call, String> {
    match argv {
        [flag] if flag == "--help" || flag == "-h" => Ok(Call::Help),
        [flag] if flag == "--version" || flag == "-V" => Ok(Call::Version),
        _ if argv.iter().any(|a| a.starts_with("--")) => {
            let flag = argv.iter().find(|a| a.starts_with("--")).unwrap();
            Err(format!("unknown flag {flag}; {USAGE} (or --help)"))
        }
        _ => parse(argv).map(Call::Mount),
    }
}

pub fn parse(argv: &[String]) -> Result<Args, String> {
    let mut args = Args::default();
    let mut positional = Vec::new();
    let mut it = argv.iter();
    while let Some(arg) = it.next() {
        let Some(flags) = arg.strip_prefix('-').filter(|f| !f.is_empty()) else {
            positional.push(arg.clone());
            continue;
        };
        let mut chars = flags.chars();
        while let Some(flag) = chars.next() {
            match flag {
                's' => args.sloppy = true,
                'f' => args.fake = true,
                'n' => {}
                'v' => args.verbose = true,
                'o' | 'N' | 't' => {
                    // The value is the rest of this word, or the next one.
                    let rest: String = chars.by_ref().collect();
                    let value = if rest.is_empty() {
                        it.next()
                            .cloned()
                            .ok_or_else(|| format!("option -{flag} needs a value"))?
                    } else {
                        rest
                    };
                    match flag {
                        'o' => args.options.extend(
                            value
                                .split(',')
                                .map(str::trim)
                                .filter(|o| !o.is_empty() && !layerfs::config::is_for_mount8(o))
                                .map(String::from),
                        ),
                        'N' => args.namespace = Some(value),
                        _ => args.fstype = Some(value),
                    }
                }
                other => return Err(format!("unknown flag -{other}")),
            }
        }
    }
    match positional.as_slice() {
        [source, mountpoint] => {
            args.source = PathBuf::from(source);
            args.mountpoint = PathBuf::from(mountpoint);
        }
        _ => return Err(format!("{USAGE} (or --help)")),
    }
    if let Some(t) = &args.fstype {
        if t != "layerfs" && t != "fuse.layerfs" {
            return Err(format!("filesystem type '{t}' is not layerfs"));
        }
    }
    Ok(args)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn argv(s: &str) -> Vec<String> {
        s.split_whitespace().map(String::from).collect()
    }

    #[test]
    fn the_mount8_form_parses() {
        let a = parse(&argv(
            "/srv/remote /mnt -o local=/l,allow_other,_netdev,x-systemd.after=x -n -v",
        ))
        .unwrap();
        assert_eq!(a.source, PathBuf::from("/srv/remote"));
        assert_eq!(a.mountpoint, PathBuf::from("/mnt"));
        assert_eq!(a.options, vec!["local=/l", "allow_other"]);
        assert!(a.verbose && !a.fake && !a.sloppy);
    }

    #[test]
    fn flags_combine_and_values_attach() {
        let a = parse(&argv("-sfv r m -olocal=/x -N 1234 -t fuse.layerfs")).unwrap();
        assert!(a.sloppy && a.fake && a.verbose);
        assert_eq!(a.options, vec!["local=/x"]);
        assert_eq!(a.namespace.as_deref(), Some("1234"));
        assert_eq!(a.fstype.as_deref(), Some("fuse.layerfs"));
    }

    #[test]
    fn every_foreign_option_is_dropped() {
        let a = parse(&argv("r m -o defaults,nofail,_netdev,auto,noauto,user,users,comment=a=b,x-mount.mkdir,user=bob,ro")).unwrap();
        assert_eq!(a.options, vec!["ro"]);
    }

    #[test]
    fn help_and_version_are_asked_alone() {
        assert_eq!(parse_call(&argv("--help")), Ok(Call::Help));
        assert_eq!(parse_call(&argv("-h")), Ok(Call::Help));
        assert_eq!(parse_call(&argv("--version")), Ok(Call::Version));
        assert!(parse_call(&argv("r m --bogus"))
            .unwrap_err()
            .contains("--bogus"));
        assert!(matches!(parse_call(&argv("r m -o ro")), Ok(Call::Mount(_))));
        let help = help();
        assert!(
            help.contains("usage: mount.layerfs") && help.contains("local="),
            "{help}"
        );
    }

    #[test]
    fn bad_calls_say_why() {
        assert!(parse(&argv("onlyone")).unwrap_err().contains("usage"));
        assert!(parse(&argv("r m -o"))
            .unwrap_err()
            .contains("-o needs a value"));
        assert!(parse(&argv("r m -q")).unwrap_err().contains("-q"));
        assert!(parse(&argv("r m -t ext4")).unwrap_err().contains("ext4"));
    }
}
