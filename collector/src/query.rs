//! Label selectors in PromQL's syntax (`{node="n1", comm=~"ray::.*"}`) and query times.

use regex::Regex;

use crate::store::LabelSet;

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum QueryError {
    #[error("bad query at byte {at}: {what} (expected e.g. {{node=\"n1\", comm=~\"ray::.*\"}})")]
    Syntax { at: usize, what: String },
    #[error("bad regex for label {label}: {reason}")]
    Regex { label: String, reason: String },
    #[error("bad time '{0}': use Unix seconds, 'now' or 'now-1h' (units s, m, h, d)")]
    Time(String),
}

#[derive(Debug, Clone)]
enum Op {
    Eq(String),
    Ne(String),
    Re(Regex),
    NotRe(Regex),
}

#[derive(Debug, Clone)]
pub struct Matcher {
    label: String,
    op: Op,
}

impl Matcher {
    /// A missing label matches as the empty string, as in PromQL: `{x=""}` selects sets
    /// without `x`, `{x!=""}` those with it.
    fn matches(&self, labels: &LabelSet) -> bool {
        let v = labels.get(&self.label).map_or("", String::as_str);
        match &self.op {
            Op::Eq(want) => v == want,
            Op::Ne(want) => v != want,
            Op::Re(re) => re.is_match(v),
            Op::NotRe(re) => !re.is_match(v),
        }
    }
}

/// All matchers must hold.
#[derive(Debug, Clone, Default)]
pub struct Selector(Vec<Matcher>);

impl Selector {
    pub fn matches(&self, labels: &LabelSet) -> bool {
        self.0.iter().all(|m| m.matches(labels))
    }

    pub fn parse(text: &str) -> Result<Selector, QueryError> {
        let mut p = Parser { s: text, pos: 0 };
        p.skip_ws();
        if p.rest().is_empty() {
            return Ok(Selector::default());
        }
        p.expect('{')?;
        let mut matchers = Vec::new();
        loop {
            p.skip_ws();
            if p.eat('}') {
                break;
            }
            let label = p.ident()?;
            p.skip_ws();
            let op = if p.eat_str("=~") {
                "=~"
            } else if p.eat_str("!~") {
                "!~"
            } else if p.eat_str("!=") {
                "!="
            } else if p.eat('=') {
                "="
            } else {
                return Err(p.error("expected one of = != =~ !~"));
            };
            p.skip_ws();
            let value = p.string()?;
            let regex = |v: &str| {
                // Anchored, as in PromQL: `comm=~"ray"` does not match "ray::Task".
                Regex::new(&format!("^(?:{v})$")).map_err(|e| QueryError::Regex {
                    label: label.clone(),
                    reason: e
                        .to_string()
                        .lines()
                        .last()
                        .unwrap_or("")
                        .trim()
                        .to_string(),
                })
            };
            let op = match op {
                "=" => Op::Eq(value),
                "!=" => Op::Ne(value),
                "=~" => Op::Re(regex(&value)?),
                _ => Op::NotRe(regex(&value)?),
            };
            matchers.push(Matcher { label, op });
            p.skip_ws();
            if p.eat(',') {
                continue;
            }
            p.skip_ws();
            p.expect('}')?;
            break;
        }
        p.skip_ws();
        if !p.rest().is_empty() {
            return Err(p.error("unexpected text after '}'"));
        }
        Ok(Selector(matchers))
    }
}

struct Parser<'a> {
    s: &'a str,
    pos: usize,
}

impl Parser<'_> {
    fn rest(&self) -> &str {
        &self.s[self.pos..]
    }

    fn error(&self, what: &str) -> QueryError {
        QueryError::Syntax {
            at: self.pos,
            what: what.to_string(),
        }
    }

    fn skip_ws(&mut self) {
        let trimmed = self.rest().trim_start();
        self.pos = self.s.len() - trimmed.len();
    }

    fn eat(&mut self, c: char) -> bool {
        if self.rest().starts_with(c) {
            self.pos += c.len_utf8();
            true
        } else {
            false
        }
    }

    fn eat_str(&mut self, t: &str) -> bool {
        if self.rest().starts_with(t) {
            self.pos += t.len();
            true
        } else {
            false
        }
    }

    fn expect(&mut self, c: char) -> Result<(), QueryError> {
        if self.eat(c) {
            Ok(())
        } else {
            Err(self.error(&format!("expected '{c}'")))
        }
    }

    fn ident(&mut self) -> Result<String, QueryError> {
        let rest = self.rest();
        let len = rest
            .char_indices()
            .find(|&(i, c)| !(c == '_' || c.is_ascii_alphabetic() || (i > 0 && c.is_ascii_digit())))
            .map_or(rest.len(), |(i, _)| i);
        if len == 0 {
            return Err(self.error("expected a label name"));
        }
        let name = rest[..len].to_string();
        self.pos += len;
        Ok(name)
    }

    /// A double- or single-quoted string with backslash escapes.
    fn string(&mut self) -> Result<String, QueryError> {
        let quote = match self.rest().chars().next() {
            Some(q @ ('"' | '\'')) => q,
            _ => return Err(self.error("expected a quoted value")),
        };
        self.pos += 1;
        let mut out = String::new();
        let mut chars = self.rest().char_indices();
        while let Some((i, c)) = chars.next() {
            if c == quote {
                self.pos += i + 1;
                return Ok(out);
            }
            if c == '\\' {
                match chars.next() {
                    Some((_, 'n')) => out.push('\n'),
                    Some((_, 't')) => out.push('\t'),
                    Some((_, e)) => {
                        // Regex escapes such as `\.` pass through for the regex to read.
                        if e != quote && e != '\\' {
                            out.push('\\');
                        }
                        out.push(e);
                    }
                    None => break,
                }
            } else {
                out.push(c);
            }
        }
        self.pos = self.s.len();
        Err(self.error("unterminated string"))
    }
}

/// Parses a query time: Unix seconds (fractions allowed), `now`, or `now-DURATION`.
pub fn parse_time(text: &str, now_s: i64) -> Result<i64, QueryError> {
    let t = text.trim();
    let err = || QueryError::Time(text.to_string());
    if t == "now" {
        return Ok(now_s);
    }
    if let Some(ago) = t.strip_prefix("now-") {
        let split = ago.find(|c: char| !c.is_ascii_digit()).unwrap_or(ago.len());
        let (n, unit) = ago.split_at(split);
        let n: i64 = n.parse().map_err(|_| err())?;
        let mult = match unit {
            "" | "s" => 1,
            "m" => 60,
            "h" => 3600,
            "d" => 86400,
            _ => return Err(err()),
        };
        return n.checked_mul(mult).map(|d| now_s - d).ok_or_else(err);
    }
    let secs: f64 = t.parse().map_err(|_| err())?;
    if !secs.is_finite() || !(0.0..=1e12).contains(&secs) {
        return Err(err());
    }
    Ok(secs as i64)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn set(pairs: &[(&str, &str)]) -> LabelSet {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn matchers() {
        let s =
            Selector::parse(r#"{node="n1", comm=~"ray::.*", pid!="7", thread!~'gc.*'}"#).unwrap();
        assert!(s.matches(&set(&[
            ("node", "n1"),
            ("comm", "ray::Train"),
            ("thread", "main")
        ])));
        assert!(!s.matches(&set(&[("node", "n2"), ("comm", "ray::Train")])));
        assert!(!s.matches(&set(&[("node", "n1"), ("comm", "xray::T")])));
        assert!(!s.matches(&set(&[("node", "n1"), ("comm", "ray::T"), ("pid", "7")])));
        assert!(!s.matches(&set(&[
            ("node", "n1"),
            ("comm", "ray::T"),
            ("thread", "gc0")
        ])));
        assert!(Selector::parse("").unwrap().matches(&set(&[])));
        assert!(Selector::parse("{}").unwrap().matches(&set(&[("a", "b")])));
        let dot = Selector::parse(r#"{comm=~"a\.b"}"#).unwrap();
        assert!(dot.matches(&set(&[("comm", "a.b")])));
        assert!(!dot.matches(&set(&[("comm", "axb")])));
    }

    #[test]
    fn errors_name_the_place() {
        for bad in [
            r#"{node="n1""#,
            "{node}",
            r#"{1x="a"}"#,
            r#"node="n1""#,
            r#"{a=~"("}"#,
            r#"{a="b"} x"#,
        ] {
            let e = Selector::parse(bad).unwrap_err();
            assert!(!e.to_string().is_empty(), "{bad}");
        }
    }

    #[test]
    fn times() {
        assert_eq!(parse_time("now", 1000), Ok(1000));
        assert_eq!(parse_time("now-1h", 10_000), Ok(6400));
        assert_eq!(parse_time("now-30", 100), Ok(70));
        assert_eq!(parse_time("1700000000.5", 0), Ok(1_700_000_000));
        assert!(parse_time("yesterday", 0).is_err());
        assert!(parse_time("now-1y", 0).is_err());
    }
}
