//! Property tests of the intent fingerprint: delivery details never change it; any change of
//! the effect always does.

use std::collections::BTreeMap;

use proptest::prelude::*;
use serde_json::{Map, Value};
use waymark_core::{
    ActionRequest, Actor, Delivery, FingerprintKey, IntentScope, SecretValue, Target, Word,
    WordPart,
};

fn key() -> FingerprintKey {
    FingerprintKey::from_bytes(*b"waymark-test-fingerprint-key-32b")
}

/// Tool arguments as an agent sends them: a JSON object. The gateway renders them into argv in
/// the tool's argument order; this stand-in renders `--name=value` sorted by name.
fn render(args: &Map<String, Value>, secret: &str) -> Vec<Word> {
    let mut names: Vec<&String> = args.keys().collect();
    names.sort();
    let mut argv = vec![Word::literal("tool-bin")];
    for n in names {
        let v = match &args[n] {
            Value::String(s) => s.clone(),
            other => other.to_string(),
        };
        argv.push(Word::literal(format!("--{n}={v}")));
    }
    argv.push(Word(vec![
        WordPart::Literal("--secret=".into()),
        WordPart::Secret {
            name: "password".into(),
            value: SecretValue::new(secret),
        },
    ]));
    argv
}

fn request_from_json(json_text: &str, delivery: Delivery) -> ActionRequest {
    let args: Map<String, Value> = serde_json::from_str(json_text).expect("valid JSON");
    ActionRequest {
        actor: Actor("uid:1000:/usr/bin/agent".into()),
        tool: "restart_service".into(),
        channel: "ssh-exec".into(),
        target: Target {
            user: "ops".into(),
            host: "web1.example".into(),
            port: 22,
        },
        credential_ref: "ops-key".into(),
        argv: render(&args, "s3cret"),
        cwd: Some("/srv/app".into()),
        env: BTreeMap::from([("LANG".to_string(), Word::literal("C"))]),
        scope: IntentScope::ToolWindow,
        delivery,
    }
}

/// Writes `args` as JSON text with keys in the given order and arbitrary whitespace.
fn write_json(args: &[(String, Value)], order: &[usize], ws: &[&str]) -> String {
    let mut out = String::from("{");
    out.push_str(ws[0]);
    for (i, &idx) in order.iter().enumerate() {
        if i > 0 {
            out.push(',');
            out.push_str(ws[i % ws.len()]);
        }
        let (k, v) = &args[idx];
        out.push_str(&Value::String(k.clone()).to_string());
        out.push_str(ws[(i + 1) % ws.len()]);
        out.push(':');
        out.push_str(ws[(i + 2) % ws.len()]);
        out.push_str(&v.to_string());
    }
    out.push_str(ws[1 % ws.len()]);
    out.push('}');
    out
}

fn arg_value() -> impl Strategy<Value = Value> {
    prop_oneof![
        any::<String>().prop_map(Value::String),
        any::<i64>().prop_map(|n| Value::Number(n.into())),
        any::<bool>().prop_map(Value::Bool),
    ]
}

fn args_strategy() -> impl Strategy<Value = Vec<(String, Value)>> {
    prop::collection::btree_map("[a-z_]{1,8}", arg_value(), 0..6)
        .prop_map(|m| m.into_iter().collect())
}

fn delivery_strategy() -> impl Strategy<Value = Delivery> {
    (
        prop_oneof![
            Just(None),
            any::<i64>().prop_map(|n| Some(Value::Number(n.into()))),
            "[a-z0-9-]{1,20}".prop_map(|s| Some(Value::String(s))),
        ],
        prop::option::of("[a-f0-9]{8,32}"),
        prop::option::of(prop_oneof![
            Just("stdio".to_string()),
            Just("http".to_string())
        ]),
    )
        .prop_map(|(jsonrpc_id, mcp_session, transport)| Delivery {
            jsonrpc_id,
            mcp_session,
            transport,
        })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn key_order_whitespace_and_delivery_never_change_the_fingerprint(
        args in args_strategy(),
        seed in any::<u64>(),
        ws in prop::collection::vec(prop::sample::select(vec!["", " ", "\n", "\t", "  \r\n "]), 3),
        d1 in delivery_strategy(),
        d2 in delivery_strategy(),
    ) {
        let mut order: Vec<usize> = (0..args.len()).collect();
        let canonical_order = order.clone();
        // A seeded shuffle: a different key order each case.
        let mut s = seed;
        for i in (1..order.len()).rev() {
            s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            order.swap(i, (s >> 33) as usize % (i + 1));
        }
        let a = request_from_json(&write_json(&args, &canonical_order, &[""]), d1);
        let b = request_from_json(&write_json(&args, &order, &ws), d2);
        prop_assert_eq!(a.canonicalize(&key()), b.canonicalize(&key()));
        prop_assert_eq!(a.fingerprint(&key()), b.fingerprint(&key()));
    }

    #[test]
    fn any_change_of_the_effect_changes_the_fingerprint(
        args in args_strategy(),
        field in 0usize..11,
        text in "[ -~]{1,12}",
        port in 1u16..,
    ) {
        let base = request_from_json(&write_json(&args, &(0..args.len()).collect::<Vec<_>>(), &[""]), Delivery::default());
        let mut changed = base.clone();
        match field {
            0 => changed.actor.0.push_str(&text),
            1 => changed.tool.push_str(&text),
            2 => changed.target.host.push_str(&text.to_ascii_lowercase().replace(|c: char| !c.is_ascii_alphanumeric(), "x")),
            3 => changed.target.port = if port == 22 { 2222 } else { port },
            4 => changed.target.user.push_str(&text),
            5 => changed.credential_ref.push_str(&text),
            6 => changed.argv.push(Word::literal(text.clone())),
            7 => changed.cwd = Some(format!("/srv/{text}")),
            8 => { changed.env.insert("APP_MODE".into(), Word::literal(text.clone())); }
            9 => changed.scope = IntentScope::Key(text.clone()),
            _ => {
                let last = changed.argv.len() - 1;
                changed.argv[last] = Word(vec![
                    WordPart::Literal("--secret=".into()),
                    WordPart::Secret { name: "password".into(), value: SecretValue::new(format!("s3cret{text}")) },
                ]);
            }
        }
        prop_assert_ne!(base.fingerprint(&key()), changed.fingerprint(&key()), "field {} changed", field);
        prop_assert!(!changed.canonicalize(&key()).as_str().contains("s3cret"));
    }

    #[test]
    fn argv_words_are_not_confused_by_splitting(a in "[a-z ]{0,6}", b in "[a-z ]{0,6}") {
        // ["ab", ""] and ["a", "b"] are different argv even though they concatenate alike.
        let mut r1 = request_from_json("{}", Delivery::default());
        let mut r2 = r1.clone();
        r1.argv.push(Word::literal(format!("{a}{b}")));
        r2.argv.push(Word::literal(a.clone()));
        r2.argv.push(Word::literal(b.clone()));
        prop_assert_ne!(r1.fingerprint(&key()), r2.fingerprint(&key()));
    }
}
