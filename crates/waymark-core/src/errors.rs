//! Error text for people: an error and its causes on one line.

/// `e` and each of its sources, joined by `: `, skipping a cause whose text the line already
/// holds. Client libraries' top messages ("error sending request", "db error") say too little
/// alone.
pub fn error_chain(e: &dyn std::error::Error) -> String {
    let mut out = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        let text = s.to_string();
        if !out.contains(&text) {
            out.push_str(": ");
            out.push_str(&text);
        }
        source = s.source();
    }
    out
}
