//! The HTTP channel against a real HTTP API on loopback (the test kit's), with real faults:
//! what left and what did not, the execution ID as the idempotency key, 409 and 422, caps.

use std::time::Duration;

use sha2::{Digest, Sha256};
use waymark_core::{ExecutionId, HttpMethod, Timestamp};
use waymark_http::{
    idempotency_header, read_status, HttpChannel, OutgoingRequest, SendError, StatusReading,
    DEFAULT_IDEMPOTENCY_HEADER,
};
use waymark_testkit::{free_port, HttpFault, TestHttpApi};

fn id(n: u128) -> ExecutionId {
    ExecutionId::from_parts(Timestamp::from_millis(1_800_000_000_000), n)
}

fn payment(api: &TestHttpApi, execution: ExecutionId, amount: u32) -> OutgoingRequest {
    OutgoingRequest {
        method: HttpMethod::Post,
        url: api.url("/payments"),
        headers: vec![
            idempotency_header(DEFAULT_IDEMPOTENCY_HEADER, execution),
            ("authorization".into(), "Bearer test-token".into()),
        ],
        body: Some(format!(r#"{{"amount":{amount}}}"#).into_bytes()),
        timeout: Duration::from_secs(10),
        body_cap: 64 * 1024,
        keep_headers: Vec::new(),
    }
}

fn get(url: String) -> OutgoingRequest {
    OutgoingRequest {
        method: HttpMethod::Get,
        url,
        headers: vec![],
        body: None,
        timeout: Duration::from_secs(10),
        body_cap: 1000,
        keep_headers: Vec::new(),
    }
}

#[tokio::test]
async fn a_keyed_request_carries_the_execution_id_and_a_resend_takes_the_stored_answer() {
    let api = TestHttpApi::start();
    let channel = HttpChannel::new().unwrap();
    let first = channel.send(&payment(&api, id(1), 10)).await.unwrap();
    assert_eq!(first.status, 201);
    assert_eq!(
        read_status(first.status, true),
        StatusReading::Completed { is_error: false }
    );
    let seen = api.requests();
    assert_eq!(
        seen[0].header("idempotency-key"),
        Some(id(1).to_string().as_str())
    );
    assert_eq!(seen[0].header("content-type"), Some("application/json"));

    let again = channel.send(&payment(&api, id(1), 10)).await.unwrap();
    assert_eq!(again.body, first.body, "the re-send gets the stored answer");
    assert!(
        again
            .headers
            .contains(&("idempotent-replayed".into(), "true".into())),
        "{:?}",
        again.headers
    );
    assert_eq!(api.effects(), 1, "one execution, one charge");
}

#[tokio::test]
async fn a_refused_connection_or_failed_tls_handshake_sent_nothing() {
    let channel = HttpChannel::new().unwrap();
    let closed = format!("http://127.0.0.1:{}/payments", free_port());
    match channel.send(&get(closed)).await {
        Err(SendError::NotSent(why)) => assert!(
            why.to_lowercase().contains("refused") || why.contains("connect"),
            "{why}"
        ),
        other => panic!("a refused connection must be NotSent, got {other:?}"),
    }
    // https to a server that speaks plain HTTP: the handshake fails before the request leaves.
    let api = TestHttpApi::start();
    let tls = format!("https://{}/payments", api.addr());
    match channel.send(&get(tls)).await {
        Err(SendError::NotSent(_)) => {}
        other => panic!("a failed TLS handshake must be NotSent, got {other:?}"),
    }
    assert!(api.requests().is_empty(), "no HTTP request reached the API");
}

#[tokio::test]
async fn a_reset_after_the_request_left_is_lost_never_not_sent() {
    let api = TestHttpApi::start();
    let channel = HttpChannel::new().unwrap();
    for (fault, effects) in [
        (HttpFault::ResetBeforeEffect, 0),
        (HttpFault::ResetAfterEffect, 1),
    ] {
        api.set_fault(fault.clone());
        let execution = id(10 + effects as u128);
        match channel.send(&payment(&api, execution, 5)).await {
            Err(SendError::Lost(_)) => {}
            other => {
                panic!("{fault:?}: the request left, so the outcome is unknown; got {other:?}")
            }
        }
        assert_eq!(api.effects(), effects, "{fault:?}");
    }
    // Recovery of an idempotent tool: the same execution re-sent with the same key takes the
    // answer of the charge that already happened.
    api.set_fault(HttpFault::None);
    let answer = channel.send(&payment(&api, id(11), 5)).await.unwrap();
    assert_eq!(answer.status, 201);
    assert!(answer
        .headers
        .iter()
        .any(|(k, _)| k == "idempotent-replayed"));
    assert_eq!(api.effects(), 1, "the re-send did not charge again");
}

/// The channel never re-sends on its own (reqwest retries what it deems safe unless told not
/// to): a connection reset after the request was read is one request, for a POST and for a GET.
#[tokio::test]
async fn a_connection_reset_after_the_request_was_read_is_sent_once() {
    let api = TestHttpApi::start();
    let channel = HttpChannel::new().unwrap();
    api.set_fault(HttpFault::ResetBeforeEffect);
    let sent = channel.send(&payment(&api, id(40), 5)).await;
    assert!(matches!(sent, Err(SendError::Lost(_))), "{sent:?}");
    assert_eq!(api.requests().len(), 1, "the POST was sent once");
    let sent = channel.send(&get(api.url("/echo"))).await;
    assert!(matches!(sent, Err(SendError::Lost(_))), "{sent:?}");
    assert_eq!(api.requests().len(), 2, "the GET was sent once");
}

#[tokio::test]
async fn a_timeout_or_an_answer_that_is_not_http_is_lost() {
    let api = TestHttpApi::start();
    let channel = HttpChannel::new().unwrap();
    api.set_fault(HttpFault::DelayAnswer(Duration::from_secs(3)));
    let mut req = payment(&api, id(20), 1);
    req.timeout = Duration::from_millis(500);
    match channel.send(&req).await {
        Err(SendError::Lost(why)) => assert!(why.contains("timeout"), "{why}"),
        other => panic!("a timeout after sending must be Lost, got {other:?}"),
    }
    api.set_fault(HttpFault::Garbage);
    match channel.send(&payment(&api, id(21), 1)).await {
        Err(SendError::Lost(_)) => {}
        other => panic!("garbage after sending must be Lost, got {other:?}"),
    }
}

#[tokio::test]
async fn conflict_while_in_flight_and_a_key_reused_with_another_payload_read_as_such() {
    let api = TestHttpApi::start();
    api.set_processing_time(Duration::from_millis(800));
    let channel = HttpChannel::new().unwrap();
    let first = payment(&api, id(30), 7);
    let (a, b) = tokio::join!(channel.send(&first), async {
        // The first request has arrived and is being processed.
        while api.requests().is_empty() {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        channel.send(&payment(&api, id(30), 7)).await
    });
    let (a, b) = (a.unwrap(), b.unwrap());
    assert_eq!(
        read_status(a.status, true),
        StatusReading::Completed { is_error: false }
    );
    assert_eq!(read_status(b.status, true), StatusReading::StillInFlight);
    let other = channel.send(&payment(&api, id(30), 8)).await.unwrap();
    assert_eq!(other.status, 422);
    assert_eq!(
        read_status(other.status, true),
        StatusReading::KeyReusedWithOtherPayload
    );
    assert_eq!(
        read_status(422, false),
        StatusReading::Completed { is_error: true },
        "no key: an ordinary error"
    );
    assert_eq!(api.effects(), 1);
}

#[tokio::test]
async fn an_error_status_is_a_completed_answer_and_a_redirect_is_not_followed() {
    let api = TestHttpApi::start();
    let channel = HttpChannel::new().unwrap();
    let answer = channel.send(&get(api.url("/status/503"))).await.unwrap();
    assert_eq!(answer.status, 503);
    assert_eq!(
        read_status(answer.status, true),
        StatusReading::Completed { is_error: true }
    );
    let redirect = channel.send(&get(api.url("/status/302"))).await.unwrap();
    assert_eq!(redirect.status, 302);
    assert_eq!(api.requests().len(), 2, "the redirect was not followed");
}

#[tokio::test]
async fn a_large_binary_answer_is_capped_with_its_full_size_and_hash() {
    let api = TestHttpApi::start();
    let channel = HttpChannel::new().unwrap();
    let answer = channel.send(&get(api.url("/bytes/100000"))).await.unwrap();
    let full: Vec<u8> = (0..100_000usize).map(|i| (i % 251) as u8).collect();
    assert_eq!(answer.body, full[..1000]);
    assert_eq!(answer.total, 100_000);
    assert!(answer.truncated());
    assert_eq!(answer.sha256, hex::encode(Sha256::digest(&full)));
}
