//! A `SecretValue` cannot reach the ledger or a log by accident: it has no `Serialize` (this
//! file does not compile once it has one), its `Debug` says nothing of it, and the words and
//! records that hold one show its MAC, never its text.

use waymark_core::{FingerprintKey, SecretValue, Word, WordPart};

/// Resolves only while `T` has no `Serialize`: with one, both impls apply and the call below is
/// ambiguous, so this test file stops compiling (the technique of `static_assertions`).
trait AmbiguousIfSerialize<A> {
    fn check() {}
}
impl<T: ?Sized> AmbiguousIfSerialize<()> for T {}
struct IfSerialize;
impl<T: ?Sized + serde::Serialize> AmbiguousIfSerialize<IfSerialize> for T {}

#[test]
fn a_secret_value_has_no_serialize_and_a_debug_that_says_nothing_of_it() {
    <SecretValue as AmbiguousIfSerialize<_>>::check();
    let secret = SecretValue::new("hunter2-canary");
    assert_eq!(format!("{secret:?}"), "SecretValue(<redacted>)");
    let word = Word(vec![
        WordPart::Literal("--token=".into()),
        WordPart::Secret {
            name: "token".into(),
            value: secret,
        },
    ]);
    assert!(!format!("{word:?}").contains("hunter2-canary"), "{word:?}");
    let key = FingerprintKey::from_bytes([3; 32]);
    let record = waymark_core::ActionRequest {
        actor: waymark_core::Actor("a".into()),
        tool: "t".into(),
        channel: waymark_core::SSH_CHANNEL.into(),
        target: waymark_core::Target {
            user: "u".into(),
            host: "h".into(),
            port: 22,
        },
        credential_ref: "k".into(),
        argv: vec![word],
        cwd: None,
        env: Default::default(),
        scope: waymark_core::IntentScope::ToolWindow,
        delivery: Default::default(),
    }
    .canonicalize(&key);
    assert!(
        !record.as_str().contains("hunter2-canary"),
        "{}",
        record.as_str()
    );
    assert!(
        record.as_str().contains("hmac-sha256:"),
        "{}",
        record.as_str()
    );
}
