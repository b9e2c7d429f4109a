//! Reading user input defensively: TOML documents with key positions, `--set` overrides, one-line errors.
//!
//! Every error a user can cause comes back as an [`InputError`] whose `Display` is a single line naming the
//! file and line (or the `--set` flag) and what was expected.

use std::fmt;

/// A user-facing input error: where it is (`file:line:col`, `--set k=v`, …) and what was expected.
#[derive(Debug, Clone, PartialEq)]
pub struct InputError {
    pub origin: String,
    pub msg: String,
}

impl InputError {
    pub fn new(origin: impl Into<String>, msg: impl Into<String>) -> Self {
        let msg: String = msg.into();
        // One line, always: serde and toml messages may carry newlines.
        let msg = msg.split_whitespace().collect::<Vec<_>>().join(" ");
        InputError {
            origin: origin.into(),
            msg,
        }
    }
}

impl fmt::Display for InputError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.origin, self.msg)
    }
}

impl std::error::Error for InputError {}

/// A parsed TOML document that remembers where each key was written.
pub struct SourceDoc {
    pub name: String,
    text: String,
    doc: toml_edit::ImDocument<String>,
}

impl SourceDoc {
    pub fn parse(name: &str, text: &str) -> Result<Self, InputError> {
        match toml_edit::ImDocument::parse(text.to_string()) {
            Ok(doc) => Ok(SourceDoc {
                name: name.to_string(),
                text: text.to_string(),
                doc,
            }),
            Err(e) => {
                let at = e.span().map(|s| s.start).unwrap_or(0);
                let (l, c) = line_col(text, at);
                Err(InputError::new(
                    format!("{name}:{l}:{c}"),
                    format!("invalid TOML: {}", e.message()),
                ))
            }
        }
    }

    /// The document as a plain table (the parse above already succeeded).
    pub fn table(&self) -> Result<toml::Table, InputError> {
        toml::from_str::<toml::Table>(&self.text).map_err(|e| {
            InputError::new(self.name.clone(), format!("invalid TOML: {}", e.message()))
        })
    }

    /// `name:line:col` of the deepest key of `path` present in the document, and whether all of `path` was found.
    pub fn locate(&self, path: &[String]) -> (String, bool) {
        let mut offset = None;
        let mut found = 0;
        let mut cur: Option<&dyn toml_edit::TableLike> = Some(self.doc.as_table());
        for seg in path {
            let Some(t) = cur else { break };
            let Some((k, item)) = t.get_key_value(seg) else {
                break;
            };
            if let Some(s) = k.span() {
                offset = Some(s.start);
            }
            found += 1;
            cur = item.as_table_like();
        }
        let loc = match offset {
            Some(o) => {
                let (l, c) = line_col(&self.text, o);
                format!("{}:{l}:{c}", self.name)
            }
            None => self.name.clone(),
        };
        (loc, found == path.len())
    }
}

/// 1-based line and column of a byte offset.
pub fn line_col(text: &str, offset: usize) -> (usize, usize) {
    let offset = offset.min(text.len());
    let before = &text[..offset];
    let line = before.matches('\n').count() + 1;
    let col = before.rfind('\n').map(|i| offset - i).unwrap_or(offset + 1);
    (line, col)
}

/// Split `a.b."c.d"` into segments (quoted segments may contain dots).
pub fn split_key(key: &str) -> Result<Vec<String>, String> {
    let mut out = Vec::new();
    let mut cur = String::new();
    let mut quoted = false;
    for ch in key.chars() {
        match ch {
            '"' => quoted = !quoted,
            '.' if !quoted => out.push(std::mem::take(&mut cur)),
            c => cur.push(c),
        }
    }
    out.push(cur);
    if quoted || out.iter().any(|s| s.trim().is_empty()) {
        return Err(format!(
            "`{key}` is not a key path (expected e.g. `workload.nic_rx.queues`)"
        ));
    }
    Ok(out.into_iter().map(|s| s.trim().to_string()).collect())
}

/// Parse the value of `--set k=v`: a TOML value (`4`, `true`, `"x"`, `[1, 2]`), else a bare string.
pub fn parse_value(raw: &str) -> toml::Value {
    let raw = raw.trim();
    match toml::from_str::<toml::Table>(&format!("v = {raw}")) {
        Ok(mut t) => t
            .remove("v")
            .unwrap_or_else(|| toml::Value::String(raw.to_string())),
        Err(_) => toml::Value::String(raw.to_string()),
    }
}

/// Set `path` in `table` to `value`, creating intermediate tables.
pub fn set_path(
    table: &mut toml::Table,
    path: &[String],
    value: toml::Value,
) -> Result<(), String> {
    let (last, parents) = path.split_last().ok_or("empty key")?;
    let mut cur = table;
    for (i, seg) in parents.iter().enumerate() {
        let entry = cur
            .entry(seg.clone())
            .or_insert_with(|| toml::Value::Table(toml::Table::new()));
        cur = match entry {
            toml::Value::Table(t) => t,
            _ => {
                return Err(format!(
                    "`{}` is a value, not a table",
                    path[..=i].join(".")
                ))
            }
        };
    }
    cur.insert(last.clone(), value);
    Ok(())
}

/// What `path` names in `table` (a value or a table), if anything.
pub fn get_path<'a>(table: &'a toml::Table, path: &[String]) -> Option<&'a toml::Value> {
    let (last, parents) = path.split_last()?;
    let mut cur = table;
    for seg in parents {
        cur = cur.get(seg)?.as_table()?;
    }
    cur.get(last)
}

/// Whether `path` names a value (not a table) in `table`.
pub fn has_path(table: &toml::Table, path: &[String]) -> bool {
    get_path(table, path).is_some_and(|v| !v.is_table())
}

/// `table[key]` as a table: None when it is absent, an error at `key` saying what was `expected` when it is
/// something else.
pub fn optional_table<'a>(
    table: &'a toml::Table,
    key: &str,
    expected: &str,
) -> Result<Option<&'a toml::Table>, (Vec<String>, String)> {
    match table.get(key) {
        None => Ok(None),
        Some(v) => v
            .as_table()
            .map(Some)
            .ok_or_else(|| (vec![key.to_string()], expected.to_string())),
    }
}

/// Remove `path` from `table` if present (empty parents are left in place).
pub fn remove_path(table: &mut toml::Table, path: &[String]) -> Option<toml::Value> {
    let (last, parents) = path.split_last()?;
    let mut cur = table;
    for seg in parents {
        cur = cur.get_mut(seg)?.as_table_mut()?;
    }
    cur.remove(last)
}

/// Deep-merge `over` into `base` (tables merge key by key; anything else replaces).
pub fn merge(base: &mut toml::Table, over: toml::Table) {
    for (k, v) in over {
        match (base.get_mut(&k), v) {
            (Some(toml::Value::Table(b)), toml::Value::Table(o)) => merge(b, o),
            (_, v) => {
                base.insert(k, v);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn line_col_counts_from_one() {
        let t = "a = 1\nbb = 2\n";
        assert_eq!(line_col(t, 0), (1, 1));
        assert_eq!(line_col(t, 6), (2, 1));
        assert_eq!(line_col(t, 9), (2, 4));
    }

    #[test]
    fn split_key_handles_quotes_and_rejects_empty() {
        assert_eq!(split_key("a.b.c").unwrap(), vec!["a", "b", "c"]);
        assert_eq!(
            split_key("compare.\"os.policy\"").unwrap(),
            vec!["compare", "os.policy"]
        );
        assert!(split_key("a..b").is_err());
        assert!(split_key("").is_err());
        assert!(split_key("a.\"b").is_err());
    }

    #[test]
    fn parse_value_falls_back_to_string() {
        assert_eq!(parse_value("4"), toml::Value::Integer(4));
        assert_eq!(parse_value("true"), toml::Value::Boolean(true));
        assert_eq!(parse_value("strict"), toml::Value::String("strict".into()));
        assert_eq!(parse_value("\"x y\""), toml::Value::String("x y".into()));
        assert!(parse_value("[1, 2]").is_array());
    }

    #[test]
    fn locate_finds_header_and_dotted_keys() {
        let d = SourceDoc::parse(
            "f.toml",
            "seed = 1\n[os]\npolicy = \"lazy\"\n[workload.nic_rx]\nqueues = 4\n",
        )
        .unwrap();
        assert_eq!(
            d.locate(&["os".into(), "policy".into()]),
            ("f.toml:3:1".to_string(), true)
        );
        assert_eq!(
            d.locate(&["workload".into(), "nic_rx".into(), "queues".into()])
                .0,
            "f.toml:5:1"
        );
        let (loc, full) = d.locate(&["os".into(), "nope".into()]);
        assert!(loc.starts_with("f.toml:2:") && !full, "{loc}");
    }

    #[test]
    fn syntax_error_names_line() {
        let e = SourceDoc::parse("f.toml", "a = 1\nb = \n").err().unwrap();
        assert!(e.origin.starts_with("f.toml:2:"), "{e}");
        assert!(!e.to_string().contains('\n'));
    }

    #[test]
    fn set_path_creates_and_refuses_values_as_tables() {
        let mut t = toml::Table::new();
        set_path(&mut t, &["a".into(), "b".into()], toml::Value::Integer(1)).unwrap();
        assert_eq!(t["a"]["b"].as_integer(), Some(1));
        assert!(set_path(
            &mut t,
            &["a".into(), "b".into(), "c".into()],
            toml::Value::Integer(1)
        )
        .is_err());
    }
}
