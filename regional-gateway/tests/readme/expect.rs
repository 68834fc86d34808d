//! Checking a command's answers against what the README shows.

use serde_json::Value;

/// How strictly `remaining` is compared.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Mode {
    /// Every field as the README shows it.
    Exact,
    /// `remaining` at most what the README shows: requests replayed against a gateway whose
    /// origin (the shared Redis) keeps counts across runs.
    Relaxed,
}

/// `actual` (a stream of JSON values) against the README's answers, one per value. Fields are
/// compared as shown, except `reset` (a timestamp: an integer); without `...` an answer must
/// have exactly the fields shown.
pub(crate) fn compare(actual: &str, expected: &[String], mode: Mode) -> Result<(), String> {
    let answers: Vec<Value> = serde_json::Deserializer::from_str(actual)
        .into_iter::<Value>()
        .collect::<Result<_, _>>()
        .map_err(|_| format!("answer is not JSON: {}", short(actual)))?;
    if answers.len() != expected.len() {
        return Err(format!(
            "expected {} JSON answer(s) as the README shows, got {}: {}",
            expected.len(),
            answers.len(),
            short(actual)
        ));
    }
    for (answer, shown) in answers.iter().zip(expected) {
        let open = shown.contains("...");
        let cleaned = shown
            .replace(",...", "")
            .replace("...,", "")
            .replace("...", "");
        let want: Value = serde_json::from_str(&cleaned)
            .map_err(|_| format!("cannot read the README's expected output: {shown}"))?;
        let (Value::Object(want), Value::Object(got)) = (&want, answer) else {
            if want != *answer {
                return Err(format!("expected {shown}, got {}", short(actual)));
            }
            continue;
        };
        for (key, value) in want {
            let Some(a) = got.get(key) else {
                return Err(format!(
                    "answer has no \"{key}\" (README: {shown}): {}",
                    short(actual)
                ));
            };
            if key == "reset" {
                if !a.is_u64() {
                    return Err(format!(
                        "\"reset\" is {a}, not a Unix time in ms: {}",
                        short(actual)
                    ));
                }
            } else if let (Mode::Relaxed, "remaining", Some(most)) =
                (mode, key.as_str(), value.as_u64())
            {
                if a.as_u64().is_none_or(|a| a > most) {
                    return Err(format!(
                        "expected \"remaining\" at most {most}, got {a}: {}",
                        short(actual)
                    ));
                }
            } else if a != value {
                return Err(format!(
                    "expected \"{key}\":{value} (README: {shown}), got \"{key}\":{a} in {}",
                    short(actual)
                ));
            }
        }
        if !open && got.len() != want.len() {
            let mut fields: Vec<&String> = got.keys().collect();
            fields.sort();
            let mut shown_fields: Vec<&String> = want.keys().collect();
            shown_fields.sort();
            return Err(format!(
                "answer has fields {fields:?}, the README shows {shown_fields:?}: {}",
                short(actual)
            ));
        }
    }
    Ok(())
}

/// An error answer in output that is JSON, for a command the README shows no output of.
pub(crate) fn error_answer(actual: &str) -> Option<String> {
    let t = actual.trim_start();
    if !(t.starts_with('{') || t.starts_with("[{")) {
        return None;
    }
    let mut values = serde_json::Deserializer::from_str(t).into_iter::<Value>();
    values
        .by_ref()
        .map_while(Result::ok)
        .any(|v| v.get("error").is_some())
        .then(|| format!("answered an error: {}", short(actual)))
}

/// The first 200 characters of an answer, on one line.
pub(crate) fn short(s: &str) -> String {
    let one: String = s.chars().filter(|&c| c != '\n').take(200).collect();
    if one.is_empty() {
        "<nothing>".into()
    } else {
        one
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shown(lines: &[&str]) -> Vec<String> {
        lines.iter().map(|l| l.to_string()).collect()
    }

    #[test]
    fn answers_compare_as_the_readme_shows_them() {
        let actual = r#"{"success":true,"limit":100,"remaining":99,"reset":1795311780123}"#;
        let exact =
            shown(&[r#"{"success":true,"limit":100,"remaining":99,"reset":1795311780000}"#]);
        assert_eq!(compare(actual, &exact, Mode::Exact), Ok(()));
        let open = shown(&[r#"{"success":true,...}"#]);
        assert_eq!(compare(actual, &open, Mode::Exact), Ok(()));
        let fewer = shown(&[r#"{"success":true,"limit":100}"#]);
        assert!(
            compare(actual, &fewer, Mode::Exact)
                .unwrap_err()
                .contains("fields")
        );
        let wrong = shown(&[r#"{"success":true,"remaining":98,...}"#]);
        assert!(
            compare(actual, &wrong, Mode::Exact)
                .unwrap_err()
                .contains("\"remaining\":98")
        );
        assert!(
            compare(actual, &wrong, Mode::Relaxed)
                .unwrap_err()
                .contains("at most 98")
        );
        let higher = shown(&[r#"{"success":true,"remaining":100,...}"#]);
        assert_eq!(compare(actual, &higher, Mode::Relaxed), Ok(()));
        assert!(
            compare(&format!("{actual}{actual}"), &open, Mode::Exact)
                .unwrap_err()
                .contains("got 2")
        );
        assert!(
            compare("curl: (7) refused", &open, Mode::Exact)
                .unwrap_err()
                .contains("not JSON")
        );
        let bad_reset = r#"{"success":true,"reset":"soon"}"#;
        assert!(compare(bad_reset, &open, Mode::Exact).is_ok());
        let reset_shown = shown(&[r#"{"reset":1,...}"#]);
        assert!(
            compare(bad_reset, &reset_shown, Mode::Exact)
                .unwrap_err()
                .contains("Unix time")
        );
    }

    #[test]
    fn an_error_answer_is_found_where_no_output_is_shown() {
        assert!(error_answer(r#"{"error":"bad_request","message":"no"}"#).is_some());
        assert!(error_answer(r#"{"success":true}{"error":"x"}"#).is_some());
        assert_eq!(error_answer(r#"{"success":true}"#), None);
        assert_eq!(error_answer("plain text"), None);
    }
}
