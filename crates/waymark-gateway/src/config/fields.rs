//! What both halves of the parser use, SSH's (`parse`) and HTTP's (`http`): where an error
//! is, `~` in paths, and a tool's arguments and durations. A leaf: it imports neither half.

use std::ops::Range;
use std::path::{Path, PathBuf};
use std::time::Duration;

use toml::Spanned;

use super::template::{is_name, parse_duration};
use super::{ArgSpec, ArgType, ConfigError, EXECUTION_ID_PLACEHOLDER};

/// Where an error is: the file and its text, to turn a span into line and column.
pub(crate) struct Locator<'a> {
    pub(super) file: &'a Path,
    pub(super) text: &'a str,
}

impl Locator<'_> {
    /// The 1-based line and column where `span` starts.
    pub(super) fn position(&self, span: Range<usize>) -> (usize, usize) {
        let before = &self.text[..span.start.min(self.text.len())];
        let line = before.matches('\n').count() + 1;
        let column = before.rsplit('\n').next().map_or(0, |l| l.chars().count()) + 1;
        (line, column)
    }

    pub(super) fn at(&self, span: Option<Range<usize>>, message: impl Into<String>) -> ConfigError {
        let (line, column) = span.map_or((0, 0), |r| self.position(r));
        ConfigError {
            file: self.file.to_path_buf(),
            line,
            column,
            message: message.into(),
        }
    }
}

/// `~` and `~/…` in a configured path, against `home`.
pub(super) fn expand_home(path: &str, home: &Path) -> PathBuf {
    match path.strip_prefix("~/") {
        Some(rest) => home.join(rest),
        None if path == "~" => home.to_path_buf(),
        None => PathBuf::from(path),
    }
}

/// A tool's typed arguments, checked.
pub(super) fn arg_specs(
    loc: &Locator<'_>,
    name: &str,
    t: &super::raw::RawTool,
) -> Result<Vec<ArgSpec>, ConfigError> {
    let mut args = Vec::new();
    for (arg_name, a) in &t.args {
        let aspan = Some(a.span());
        if arg_name == EXECUTION_ID_PLACEHOLDER {
            return Err(loc.at(aspan, format!(
                        "tool {name}: argument name {arg_name:?} is reserved: {{{arg_name}}} is the execution's own ID; rename the argument"
                    )));
        }
        if !is_name(arg_name) || arg_name == "host" {
            return Err(loc.at(
                aspan,
                format!("tool {name}: argument name {arg_name:?} is reserved or invalid"),
            ));
        }
        let a = a.get_ref();
        let values = a.values.clone().unwrap_or_default();
        if a.ty == ArgType::Enum && values.is_empty() {
            return Err(loc.at(
                aspan,
                format!("tool {name}: argument {arg_name} is an enum; list its values = [\"...\"]"),
            ));
        }
        if a.ty != ArgType::Enum && a.values.is_some() {
            return Err(loc.at(
                aspan,
                format!("tool {name}: argument {arg_name}: values apply to type = \"enum\" only"),
            ));
        }
        let pattern = match &a.pattern {
            Some(p) => Some(
                regex::Regex::new(&format!("^(?:{})$", p.get_ref())).map_err(|e| {
                    loc.at(
                        Some(p.span()),
                        format!("tool {name}: argument {arg_name}: bad pattern: {e}"),
                    )
                })?,
            ),
            None => None,
        };
        args.push(ArgSpec {
            name: arg_name.clone(),
            ty: a.ty,
            description: a.description.clone(),
            values,
            pattern,
            secret: a.secret,
            required: a.required,
        });
    }
    Ok(args)
}

/// A tool's retry window, timeout and dedup window, with their defaults.
pub(super) fn durations(
    loc: &Locator<'_>,
    name: &str,
    t: &super::raw::RawTool,
) -> Result<(Duration, Duration, Option<Duration>), ConfigError> {
    let dur = |d: &Option<Spanned<String>>| -> Result<Option<Duration>, ConfigError> {
        match d {
            Some(s) => parse_duration(s.get_ref())
                .map(Some)
                .map_err(|m| loc.at(Some(s.span()), format!("tool {name}: {m}"))),
            None => Ok(None),
        }
    };
    Ok((
        dur(&t.retry_window)?.unwrap_or(Duration::from_secs(600)),
        dur(&t.timeout)?.unwrap_or(Duration::from_secs(300)),
        dur(&t.dedup_window)?,
    ))
}
