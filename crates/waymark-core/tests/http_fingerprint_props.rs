//! Property tests of the HTTP intent fingerprint: the spellings of one request (URL case,
//! default port, query order and escaping, header-name case, body key order, delivery details)
//! share one fingerprint; any change of the effect changes it; secrets never reach the record.

use std::collections::BTreeMap;

use proptest::prelude::*;
use serde_json::{json, Value};
use waymark_core::{
    Actor, Delivery, ExecutionId, FingerprintKey, HttpActionRequest, HttpCall, HttpMethod, HttpUrl,
    IntentScope, JsonTemplate, SecretValue, Timestamp, Word, WordPart,
};

fn key() -> FingerprintKey {
    FingerprintKey::from_bytes(*b"waymark-test-fingerprint-key-32b")
}

fn secret(value: &str) -> Word {
    Word(vec![
        WordPart::Literal("Token ".into()),
        WordPart::Secret {
            name: "api_token".into(),
            value: SecretValue::new(value),
        },
    ])
}

/// A body template from JSON: every string leaf is a literal word, `"$secret"` a secret.
fn body(v: &Value, secret_value: &str) -> JsonTemplate {
    match v {
        Value::String(s) if s == "$secret" => JsonTemplate::Word(Word(vec![WordPart::Secret {
            name: "card".into(),
            value: SecretValue::new(secret_value),
        }])),
        Value::String(s) => JsonTemplate::Word(Word::literal(s.clone())),
        Value::Array(items) => {
            JsonTemplate::Array(items.iter().map(|i| body(i, secret_value)).collect())
        }
        Value::Object(map) => JsonTemplate::Object(
            map.iter()
                .map(|(k, v)| (k.clone(), body(v, secret_value)))
                .collect(),
        ),
        other => JsonTemplate::Json(other.clone()),
    }
}

struct Spec {
    method: &'static str,
    url: String,
    header_name: String,
    header_value: String,
    token: String,
    body: Value,
    card: String,
    credential: Option<String>,
    delivery: Delivery,
}

fn request(spec: &Spec) -> HttpActionRequest {
    HttpActionRequest {
        actor: Actor("uid:1000:/usr/bin/agent".into()),
        tool: "create_payment".into(),
        credential_ref: spec.credential.clone(),
        call: HttpCall {
            method: HttpMethod::parse(spec.method).unwrap(),
            url: HttpUrl::parse(&spec.url).unwrap(),
            headers: BTreeMap::from([
                (
                    HttpCall::header_name(&spec.header_name).unwrap(),
                    Word::literal(spec.header_value.clone()),
                ),
                ("x-api-token".to_string(), secret(&spec.token)),
            ]),
            body: Some(body(&spec.body, &spec.card)),
        },
        scope: IntentScope::ToolWindow,
        delivery: spec.delivery.clone(),
    }
}

fn base() -> Spec {
    Spec {
        method: "POST",
        url: "https://api.example.com/v1/payments?currency=EUR&amount=10".into(),
        header_name: "X-Tenant".into(),
        header_value: "atlas".into(),
        token: "tok-1".into(),
        body: json!({"amount": 10, "currency": "EUR", "card": "$secret", "tags": ["a", "b"]}),
        card: "4111111111111111".into(),
        credential: Some("payments".into()),
        delivery: Delivery::default(),
    }
}

fn query_strategy() -> impl Strategy<Value = Vec<(String, String)>> {
    prop::collection::btree_map("[a-z]{1,6}", "[a-zA-Z0-9 ./]{0,8}", 0..5)
        .prop_map(|m| m.into_iter().collect())
}

fn encode(s: &str, escape_all: bool) -> String {
    s.bytes()
        .map(|b| {
            if escape_all || !b.is_ascii_alphanumeric() {
                format!("%{b:02X}")
            } else {
                (b as char).to_string()
            }
        })
        .collect()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn spellings_of_one_request_share_one_fingerprint(
        query in query_strategy(),
        seed in any::<u64>(),
        upper_host in any::<bool>(),
        explicit_port in any::<bool>(),
        escape_all in any::<bool>(),
        header_upper in any::<bool>(),
        jsonrpc in any::<i64>(),
    ) {
        let plain_query: Vec<String> = query.iter().map(|(k, v)| format!("{k}={}", encode(v, false))).collect();
        let mut shuffled = query.clone();
        let mut s = seed;
        for i in (1..shuffled.len()).rev() {
            s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            shuffled.swap(i, (s >> 33) as usize % (i + 1));
        }
        let other_query: Vec<String> = shuffled.iter().map(|(k, v)| format!("{k}={}", encode(v, escape_all))).collect();
        let mut a = base();
        a.url = format!("https://api.example.com/v1/payments?{}", plain_query.join("&"));
        let mut b = base();
        b.url = format!(
            "HTTPS://{}{}/v1/./x/../payments?{}#fragment",
            if upper_host { "API.Example.COM" } else { "api.example.com" },
            if explicit_port { ":443" } else { "" },
            other_query.join("&"),
        );
        b.header_name = if header_upper { "X-TENANT".into() } else { "x-tenant".into() };
        b.method = "post";
        b.body = json!({"tags": ["a", "b"], "card": "$secret", "currency": "EUR", "amount": 10});
        b.delivery = Delivery { jsonrpc_id: Some(jsonrpc.into()), mcp_session: Some("s1".into()), transport: Some("http".into()) };
        prop_assert_eq!(request(&a).canonicalize(&key()), request(&b).canonicalize(&key()));
        prop_assert_eq!(request(&a).fingerprint(&key()), request(&b).fingerprint(&key()));
    }

    #[test]
    fn any_change_of_the_effect_changes_the_fingerprint(which in 0usize..10, text in "[a-z0-9]{1,8}") {
        let a = base();
        let mut b = base();
        match which {
            0 => b.method = "PUT",
            1 => b.url = format!("https://api.example.com/v1/payments/{text}?currency=EUR&amount=10"),
            2 => b.url = format!("https://api.example.com/v1/payments?currency=EUR&amount=10{text}"),
            3 => b.url = "https://api.example.com:8443/v1/payments?currency=EUR&amount=10".into(),
            4 => b.url = "http://api.example.com/v1/payments?currency=EUR&amount=10".into(),
            5 => b.header_value = format!("atlas{text}"),
            6 => b.token = format!("tok-{text}x"),
            7 => b.body["amount"] = json!(format!("10{text}")),
            8 => b.card = format!("4{text}"),
            _ => b.credential = Some(format!("payments-{text}")),
        }
        prop_assert_ne!(request(&a).fingerprint(&key()), request(&b).fingerprint(&key()));
    }

    #[test]
    fn secrets_never_reach_the_record(token in "[A-Za-z0-9]{12,20}", card in "[0-9]{12,19}") {
        let mut spec = base();
        spec.token = token.clone();
        spec.card = card.clone();
        let req = request(&spec);
        let record = req.canonicalize(&key());
        prop_assert!(!record.as_str().contains(&token));
        prop_assert!(!record.as_str().contains(&card));
        let id = ExecutionId::from_parts(Timestamp::from_millis(1_700_000_000_000), 1);
        let sent = String::from_utf8(req.exposed_body(id).unwrap()).unwrap();
        prop_assert!(sent.contains(&card), "the body that is sent carries the secret: {}", sent);
    }
}

#[test]
fn the_execution_id_is_sent_but_recorded_as_its_placeholder() {
    let mut req = request(&base());
    req.call.body = Some(JsonTemplate::Object(BTreeMap::from([(
        "reference".to_string(),
        JsonTemplate::Word(Word(vec![
            WordPart::Literal("wm-".into()),
            WordPart::ExecutionId,
        ])),
    )])));
    let first = ExecutionId::from_parts(Timestamp::from_millis(1_700_000_000_000), 1);
    let second = ExecutionId::from_parts(Timestamp::from_millis(1_700_000_000_000), 2);
    let sent: Value = serde_json::from_slice(&req.exposed_body(first).unwrap()).unwrap();
    assert_eq!(sent["reference"], json!(format!("wm-{first}")));
    let record = req.canonicalize(&key());
    assert!(!record.as_str().contains("act_"), "{}", record.as_str());
    assert!(
        record
            .as_str()
            .contains(r#""body_templated":["/reference"]"#),
        "{}",
        record.as_str()
    );
    assert_ne!(req.exposed_body(first), req.exposed_body(second));
}

#[test]
fn a_literal_body_shaped_like_a_recorded_word_is_not_confused_with_one() {
    let templated = JsonTemplate::Word(Word(vec![WordPart::ExecutionId]));
    let mut a = request(&base());
    a.call.body = Some(templated.clone());
    let mut b = request(&base());
    b.call.body = Some(JsonTemplate::Json(
        json!({"parts": [{"placeholder": "execution_id"}]}),
    ));
    assert_ne!(a.fingerprint(&key()), b.fingerprint(&key()));
}

#[test]
fn urls_and_methods_that_waymark_refuses_say_why() {
    for (url, says) in [
        ("ftp://example.com/x", "http:// or https://"),
        ("https://user:pw@example.com/", "[credentials]"),
        ("/relative/path", "not a valid URL"),
    ] {
        let e = HttpUrl::parse(url).unwrap_err().to_string();
        assert!(e.contains(says), "{url}: {e}");
    }
    assert!(HttpMethod::parse("TRACE")
        .unwrap_err()
        .to_string()
        .contains("GET, HEAD, POST"));
    assert!(HttpCall::header_name("bad header").is_err());
    let url = HttpUrl::parse("HTTPS://API.example.com/a/../b?z=1&a=2").unwrap();
    assert_eq!(url.target(), "https://api.example.com:443/b");
    assert_eq!(url.as_sent(), "HTTPS://API.example.com/a/../b?z=1&a=2");
}
