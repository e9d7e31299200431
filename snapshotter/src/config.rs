//! The command line and the configuration file (TOML), merged into [`Settings`].
//!
//! Every flag has a key of the same name (`--metrics-address` is `metrics_address`), and a
//! flag given on the command line wins over the file, as with containerd's stargz and
//! nydus snapshotters: a unit file can name one config file and an operator can still
//! override a setting for one run.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use clap::Parser;
use serde::Deserialize;

use crate::snapshots;

/// Read when present; `--config` names another file, which must then exist.
pub const DEFAULT_CONFIG: &str = "/etc/layerfs/snapshotter.toml";
pub const DEFAULT_ADDRESS: &str = "/run/layerfs/snapshotter.sock";
pub const DEFAULT_DRIVER: &str = "overlay";
pub const DEFAULT_LOG_LEVEL: &str = "info";

/// A containerd proxy snapshotter that stores snapshots in a layerfs mount, adopts layers
/// the shared tree already holds, and enforces snapshot quotas.
///
/// Every option can also be set in the configuration file, under the option's name with
/// `_` for `-`; the command line wins.
///
/// The same struct is the configuration file, so that no flag can lack its key. Every key is
/// optional; a key this version does not know is an error rather than silently ignored, so
/// a misspelt setting is never mistaken for a default.
#[derive(Debug, Default, Clone, PartialEq, Eq, Parser, Deserialize)]
#[command(name = "layerfs-snapshotter", version)]
#[serde(deny_unknown_fields)]
pub struct Args {
    /// The configuration file (TOML) [default: /etc/layerfs/snapshotter.toml, if present]
    #[arg(long, value_name = "FILE")]
    #[serde(skip)]
    pub config: Option<PathBuf>,
    /// The unix socket to serve on (`address` of `[proxy_plugins.layerfs]`)
    /// [default: /run/layerfs/snapshotter.sock]
    #[arg(long, value_name = "PATH")]
    pub address: Option<PathBuf>,
    /// Where snapshots are kept: a directory inside a layerfs mount for quotas and shared
    /// layers (created if missing) [required here or in the file]
    #[arg(long, value_name = "DIR")]
    pub root: Option<PathBuf>,
    /// The layerfs view whose shared layers are adopted [default: the layerfs mount
    /// `--root` is in, if any]
    #[arg(long, value_name = "DIR")]
    pub view: Option<PathBuf>,
    /// The storage driver's directory names in the view (`overlay` for `overlay/RO/…`)
    /// [default: overlay]
    #[arg(long, value_name = "NAME")]
    pub driver: Option<String>,
    /// Keep the writable dirs of snapshots without a quota on the local disk, outside the
    /// view, so containers write at kernel overlayfs speed [default: true]
    #[arg(
        long,
        value_name = "BOOL",
        num_args = 0..=1,
        require_equals = true,
        default_missing_value = "true"
    )]
    pub fast_path: Option<bool>,
    /// Where the fast path keeps those dirs [default: `.layerfs-snapshotter/<root's path in
    /// the mount>` in the layerfs mount's local directory]
    #[arg(long, value_name = "DIR")]
    pub local_root: Option<PathBuf>,
    /// Serve Prometheus metrics over HTTP at http://ADDR:PORT/metrics [default: off]
    #[arg(long, value_name = "ADDR:PORT")]
    pub metrics_address: Option<SocketAddr>,
    /// error, warn, info, debug, trace, or a filter such as `layerfs_snapshotter=debug,info`;
    /// the LAYERFS_LOG environment variable, when set, wins [default: info]
    #[arg(long, value_name = "LEVEL")]
    pub log_level: Option<String>,
}

/// What the snapshotter runs with: the command line over the file over the defaults.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Settings {
    pub address: PathBuf,
    pub root: PathBuf,
    /// `None`: the layerfs mount `root` is in, found at start-up.
    pub view: Option<PathBuf>,
    pub driver: String,
    pub fast_path: bool,
    pub local_root: Option<PathBuf>,
    pub metrics_address: Option<SocketAddr>,
    pub log_level: String,
    /// The file read, if any.
    pub config_file: Option<PathBuf>,
}

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("cannot read the configuration file {}: {source}", path.display())]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{}:{line}: {message}", path.display())]
    Parse {
        path: PathBuf,
        line: usize,
        message: String,
    },
    #[error("no snapshot root: give --root, or `root` in the configuration file")]
    NoRoot,
}

impl Args {
    /// Reads the configuration file `path`. A missing file is an error here: whether one may be missing is the
    /// caller's decision.
    pub fn read_file(path: &Path) -> Result<Args, Error> {
        let text = std::fs::read_to_string(path).map_err(|source| Error::Read {
            path: path.to_owned(),
            source,
        })?;
        Args::from_toml(&text).map_err(|(line, message)| Error::Parse {
            path: path.to_owned(),
            line,
            message,
        })
    }

    /// Parses a file's text; an error comes with the line it is on and names the key.
    pub fn from_toml(text: &str) -> Result<Args, (usize, String)> {
        toml::from_str(text).map_err(|e| {
            let start = e.span().map_or(0, |s| s.start).min(text.len());
            let line = text[..start].matches('\n').count() + 1;
            let message = e.message().trim_end().to_owned();
            // toml names the key of an unknown field but not the one a bad value belongs
            // to; the line it points at does.
            let key = text
                .lines()
                .nth(line - 1)
                .and_then(|l| l.split_once('='))
                .map(|(k, _)| k.trim())
                .filter(|k| !k.is_empty() && !k.starts_with('#'));
            match key {
                Some(key) if !message.contains(&format!("`{key}`")) => {
                    (line, format!("`{key}`: {message}"))
                }
                _ => (line, message),
            }
        })
    }
}

impl Settings {
    /// Merges the command line with the configuration file it names, or the default one
    /// when that exists.
    pub fn load(args: Args) -> Result<Settings, Error> {
        let (file, config_file) = match &args.config {
            Some(path) => (Args::read_file(path)?, Some(path.clone())),
            None => {
                let path = Path::new(DEFAULT_CONFIG);
                match Args::read_file(path) {
                    Ok(file) => (file, Some(path.to_owned())),
                    Err(Error::Read { source, .. })
                        if source.kind() == std::io::ErrorKind::NotFound =>
                    {
                        (Args::default(), None)
                    }
                    Err(e) => return Err(e),
                }
            }
        };
        Settings::merge(args, file, config_file)
    }

    /// The command line over `file` over the defaults.
    pub fn merge(args: Args, file: Args, config_file: Option<PathBuf>) -> Result<Settings, Error> {
        Ok(Settings {
            address: args
                .address
                .or(file.address)
                .unwrap_or_else(|| DEFAULT_ADDRESS.into()),
            root: args.root.or(file.root).ok_or(Error::NoRoot)?,
            view: args.view.or(file.view),
            driver: args
                .driver
                .or(file.driver)
                .unwrap_or_else(|| DEFAULT_DRIVER.into()),
            fast_path: args.fast_path.or(file.fast_path).unwrap_or(true),
            local_root: args.local_root.or(file.local_root),
            metrics_address: args.metrics_address.or(file.metrics_address),
            log_level: args
                .log_level
                .or(file.log_level)
                .unwrap_or_else(|| DEFAULT_LOG_LEVEL.into()),
            config_file,
        })
    }

    /// The snapshotter's own settings, with `view` as found (the explicit one or the
    /// mount `root` is in).
    pub fn snapshots(&self, view: Option<PathBuf>) -> snapshots::Config {
        snapshots::Config {
            view,
            driver: self.driver.clone(),
            fast_path: self.fast_path,
            local_root: self.local_root.clone(),
            ..snapshots::Config::new(&self.root)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    const EXAMPLE: &str = include_str!("../../deploy/systemd/snapshotter.toml");

    /// The field names serde knows the file by, asked of serde itself so that the list
    /// cannot drift from the struct.
    fn file_keys() -> Vec<&'static str> {
        use serde::de::{self, Visitor};

        struct Fields(Vec<&'static str>);
        impl<'de> de::Deserializer<'de> for &mut Fields {
            type Error = de::value::Error;
            fn deserialize_any<V: Visitor<'de>>(self, _: V) -> Result<V::Value, Self::Error> {
                Err(de::Error::custom("only a struct"))
            }
            fn deserialize_struct<V: Visitor<'de>>(
                self,
                _: &'static str,
                fields: &'static [&'static str],
                _: V,
            ) -> Result<V::Value, Self::Error> {
                self.0 = fields.to_vec();
                Err(de::Error::custom("fields read"))
            }
            serde::forward_to_deserialize_any! {
                bool i8 i16 i32 i64 i128 u8 u16 u32 u64 u128 f32 f64 char str string bytes
                byte_buf option unit unit_struct newtype_struct seq tuple tuple_struct map
                enum identifier ignored_any
            }
        }
        let mut fields = Fields(Vec::new());
        let _ = Args::deserialize(&mut fields);
        fields.0
    }

    fn flags() -> Vec<String> {
        Args::command()
            .get_arguments()
            .map(|a| a.get_id().as_str().to_owned())
            .filter(|id| !matches!(id.as_str(), "config" | "help" | "version"))
            .collect()
    }

    #[test]
    fn every_flag_has_a_key_and_every_key_a_flag() {
        let mut flags = flags();
        let mut keys: Vec<String> = file_keys().into_iter().map(str::to_owned).collect();
        flags.sort();
        keys.sort();
        assert!(!keys.is_empty());
        assert_eq!(flags, keys);
        for arg in Args::command().get_arguments() {
            if let Some(long) = arg.get_long() {
                assert_eq!(long.replace('-', "_"), arg.get_id().as_str());
            }
        }
    }

    #[test]
    fn the_example_parses_and_shows_every_key() {
        let file = Args::from_toml(EXAMPLE).unwrap_or_else(|(line, e)| panic!("line {line}: {e}"));
        assert!(file.root.is_some());
        // A key left at its default is shown commented out: `# key = value`.
        for key in file_keys() {
            let shown = EXAMPLE.lines().any(|l| {
                let l = l.trim_start_matches(['#', ' ']);
                l.split_once('=').is_some_and(|(k, _)| k.trim() == key)
            });
            assert!(shown, "the example does not show `{key}`");
        }
        // Uncommenting every key must still parse: the commented values are valid too.
        let uncommented: String = EXAMPLE
            .lines()
            .map(|l| match l.strip_prefix("# ") {
                Some(rest)
                    if rest
                        .split_once('=')
                        .is_some_and(|(k, _)| file_keys().contains(&k.trim())) =>
                {
                    rest
                }
                _ => l,
            })
            .map(|l| format!("{l}\n"))
            .collect();
        let all =
            Args::from_toml(&uncommented).unwrap_or_else(|(line, e)| panic!("line {line}: {e}"));
        assert!(all.address.is_some() && all.root.is_some() && all.view.is_some());
        assert!(all.driver.is_some() && all.fast_path.is_some() && all.local_root.is_some());
        assert!(all.metrics_address.is_some() && all.log_level.is_some());
    }

    #[test]
    fn an_unknown_key_is_named() {
        let (line, message) = Args::from_toml("root = \"/r\"\n\nfast_pth = false\n").unwrap_err();
        assert_eq!(line, 3);
        assert!(message.contains("fast_pth"), "{message}");
    }

    #[test]
    fn a_bad_value_names_its_key_and_line() {
        let (line, message) = Args::from_toml("root = \"/r\"\nfast_path = \"yes\"\n").unwrap_err();
        assert_eq!(line, 2);
        assert!(message.contains("fast_path"), "{message}");
        let (line, message) = Args::from_toml("\n\nmetrics_address = \"localhost\"\n").unwrap_err();
        assert_eq!(line, 3);
        assert!(message.contains("metrics_address"), "{message}");
    }

    #[test]
    fn a_syntax_error_has_its_line() {
        let (line, _) = Args::from_toml("root = \"/r\"\ndriver = \n").unwrap_err();
        assert_eq!(line, 2);
    }

    #[test]
    fn flags_win_over_the_file_and_the_file_over_the_defaults() {
        let file = Args {
            root: Some("/file/root".into()),
            driver: Some("vfs".into()),
            fast_path: Some(false),
            metrics_address: Some("127.0.0.1:9102".parse().unwrap()),
            ..Args::default()
        };
        let args =
            Args::try_parse_from(["layerfs-snapshotter", "--root", "/flag/root", "--fast-path"])
                .unwrap();
        let s = Settings::merge(args, file, None).unwrap();
        assert_eq!(s.root, Path::new("/flag/root"));
        assert_eq!(s.driver, "vfs");
        assert!(s.fast_path);
        assert_eq!(s.metrics_address, Some("127.0.0.1:9102".parse().unwrap()));
        assert_eq!(s.address, Path::new(DEFAULT_ADDRESS));
        assert_eq!(s.log_level, DEFAULT_LOG_LEVEL);

        let args = Args::try_parse_from(["x", "--fast-path=false", "--root", "/r"]).unwrap();
        let s = Settings::merge(args, Args::default(), None).unwrap();
        assert!(!s.fast_path);
        assert_eq!(s.driver, DEFAULT_DRIVER);
        assert_eq!(s.metrics_address, None);
        let config = s.snapshots(None);
        assert!(!config.fast_path);
        assert_eq!(config.root, Path::new("/r"));
    }

    #[test]
    fn a_root_is_required_somewhere() {
        let args = Args::try_parse_from(["x"]).unwrap();
        assert!(matches!(
            Settings::merge(args, Args::default(), None),
            Err(Error::NoRoot)
        ));
    }

    #[test]
    fn an_explicit_config_file_must_exist() {
        let dir = tempfile::tempdir().unwrap();
        let missing = dir.path().join("missing.toml");
        let args = Args {
            config: Some(missing),
            root: Some("/r".into()),
            ..Args::default()
        };
        let err = Settings::load(args).unwrap_err();
        assert!(matches!(err, Error::Read { .. }), "{err}");
        assert!(err.to_string().contains("missing.toml"), "{err}");

        let path = dir.path().join("s.toml");
        std::fs::write(&path, "root = \"/from/file\"\nlog_level = \"debug\"\n").unwrap();
        let args = Args::try_parse_from(["x", "--config", path.to_str().unwrap()]).unwrap();
        let s = Settings::load(args).unwrap();
        assert_eq!(s.root, Path::new("/from/file"));
        assert_eq!(s.log_level, "debug");
        assert_eq!(s.config_file.as_deref(), Some(path.as_path()));

        std::fs::write(&path, "root = \"/r\"\nview = 3\n").unwrap();
        let args = Args::try_parse_from(["x", "--config", path.to_str().unwrap()]).unwrap();
        let err = Settings::load(args).unwrap_err().to_string();
        assert!(err.contains("s.toml:2:") && err.contains("view"), "{err}");
    }
}
