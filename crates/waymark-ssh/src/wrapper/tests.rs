//! The wrapper module's unit tests: command lines built, replies parsed.

use std::time::Duration;

use super::*;

const ID: &str = "act_01J0000000000000000000000A";

fn reply(exit_status: u32, stdout: &[u8]) -> WrapperReply {
    WrapperReply {
        exit_status,
        stdout: stdout.to_vec(),
        stderr: b"why".to_vec(),
    }
}

#[test]
fn quoting_leaves_plain_words_bare_and_quotes_the_rest() {
    assert_eq!(shell_quote("abc-1.2/x").unwrap(), "abc-1.2/x");
    assert_eq!(shell_quote("").unwrap(), "''");
    assert_eq!(shell_quote("a b").unwrap(), "'a b'");
    assert_eq!(shell_quote("it's").unwrap(), "'it'\\''s'");
    assert_eq!(shell_quote("$(x)").unwrap(), "'$(x)'");
    assert_eq!(shell_quote("~").unwrap(), "'~'");
    assert_eq!(shell_quote("a=b").unwrap(), "'a=b'");
    assert!(matches!(shell_quote("a\0b"), Err(WrapperError::Nul { .. })));
}

#[test]
fn execution_ids_are_checked_like_the_wrapper_does() {
    assert!(validate_execution_id(ID).is_ok());
    for bad in [
        "act_01J0000000000000000000000",
        "act_01J0000000000000000000000AB",
        "act_01J000000000000000000000IA",
        "act_01j0000000000000000000000a",
        "xct_01J0000000000000000000000A",
        "act_01J000000000000000000000 A",
    ] {
        assert!(validate_execution_id(bad).is_err(), "{bad}");
    }
}

#[test]
fn home_relative_remote_dirs_leave_home_to_the_remote_shell() {
    let w = RemoteWrapper::default();
    let line = w.status(ID).unwrap();
    let script = format!("\"$HOME\"/.waymark/bin/{}", wrapper_name());
    assert_eq!(
        line,
        format!("test -f {script} || exit 69; exec sh {script} status {ID}")
    );
    let abs = RemoteWrapper::new(RemoteDir::new("/srv/way mark/").unwrap());
    assert!(abs
        .status(ID)
        .unwrap()
        .contains(&format!("'/srv/way mark/bin/{}'", wrapper_name())));
    assert_eq!(
        RemoteDir::new("~").unwrap().shell_word("/bin"),
        "\"$HOME\"/bin"
    );
    assert!(RemoteDir::new("~bob/x").is_err());
    assert!(RemoteDir::new("").is_err());
}

#[test]
fn other_interpreters_are_passed_to_the_supervisor() {
    let w = RemoteWrapper::default()
        .with_interpreter(&["busybox", "sh"])
        .unwrap();
    let line = w.version().unwrap();
    assert!(
        line.contains("; WAYMARK_SH='busybox sh' exec busybox sh "),
        "{line}"
    );
}

#[test]
fn start_options_become_wrapper_options() {
    let opts = StartOptions {
        timeout: Some(Duration::from_millis(1500)),
        kill_grace: Some(Duration::from_secs(2)),
        cwd: Some("/tmp/a b".into()),
        env: vec![("LANG".into(), "C".into())],
        secret_env: Vec::new(),
        secret_argv: Vec::new(),
        stdin: true,
        inline_max: Some(10),
    };
    let line = RemoteWrapper::default()
        .run(ID, &opts, &["ls", "-l"])
        .unwrap();
    assert!(line.ends_with(&format!(
        " run {ID} --timeout 2 --grace 2 --cwd '/tmp/a b' --stdin --env 'LANG=C' --inline-max 10 -- ls -l"
    )));
    let start = RemoteWrapper::default().start(ID, &opts, &["ls"]).unwrap();
    assert!(!start.contains("--inline-max"));
    let zero = StartOptions {
        timeout: Some(Duration::ZERO),
        ..StartOptions::default()
    };
    assert!(RemoteWrapper::default().start(ID, &zero, &["ls"]).is_err());
    let bad_env = StartOptions {
        env: vec![("1X".into(), "v".into())],
        ..StartOptions::default()
    };
    assert!(matches!(
        RemoteWrapper::default().start(ID, &bad_env, &["ls"]),
        Err(WrapperError::InvalidEnvName { .. })
    ));
    assert_eq!(
        RemoteWrapper::default().start::<&str>(ID, &StartOptions::default(), &[]),
        Err(WrapperError::EmptyArgv)
    );
}

#[test]
fn status_block_parses_and_garbage_is_refused() {
    let text = format!(
        "waymark-wrap/1 status\nid={ID}\nstate=completed\nlaunched=yes\ncreated_ms=1\n\
         started_ms=2\nfinished_ms=3\nsupervisor_pid=10\ncommand_pid=11\nwait_status=137\n\
         exit_code=\nsignal=9\ntimeout_s=\ncancel_requested=no\ncommand_alive=\nerror=\n\
         stdout_bytes=5\nstderr_bytes=0\nfuture_field=x\n\n"
    );
    let s = StatusReport::parse(&reply(0, text.as_bytes())).unwrap();
    assert_eq!(s.state, MarkerState::Completed);
    assert_eq!(s.signal, Some(9));
    assert_eq!(s.exit_code, None);
    assert_eq!(s.command_pid, Some(11));
    assert_eq!(s.stdout_bytes, 5);
    // Truncated before the blank line, wrong version, garbage.
    for bad in [
        &text[..text.len() - 1],
        &text.replace("wrap/1", "wrap/2"),
        "hello\n\n",
        "",
        &text.replace("state=completed", "state=exploded"),
        &text.replace("signal=9", "signal=nine"),
    ] {
        assert!(
            matches!(
                StatusReport::parse(&reply(0, bad.as_bytes())),
                Err(WrapperError::Malformed { .. })
            ),
            "{bad:?}"
        );
    }
    assert!(matches!(
        StatusReport::parse(&reply(64, b"")),
        Err(WrapperError::Usage { .. })
    ));
    assert!(matches!(
        StatusReport::parse(&reply(69, b"")),
        Err(WrapperError::NotInstalled)
    ));
}

#[test]
fn run_block_checks_inline_lengths() {
    let head = format!(
        "waymark-wrap/1 run\nid={ID}\nstate=completed\nexit_code=0\nstdout_bytes=3\nstderr_bytes=2\n"
    );
    let ok = format!("{head}stdout_inline=3\nstderr_inline=2\n\nabcde");
    match RunOutcome::parse(&reply(0, ok.as_bytes())).unwrap() {
        RunOutcome::Ran(r) => {
            assert_eq!(r.stdout, InlineOutput::Inline(b"abc".to_vec()));
            assert_eq!(r.stderr, InlineOutput::Inline(b"de".to_vec()));
        }
        other => panic!("{other:?}"),
    }
    let fetch = format!("{head}stdout_inline=-\nstderr_inline=2\n\nde");
    let RunOutcome::Ran(r) = RunOutcome::parse(&reply(0, fetch.as_bytes())).unwrap() else {
        panic!("not ran")
    };
    assert_eq!(r.stdout, InlineOutput::Fetch { size: 3 });
    for bad in [
        format!("{head}stdout_inline=3\nstderr_inline=2\n\nabcd"),
        format!("{head}stdout_inline=3\nstderr_inline=2\n\nabcdef"),
        format!("{head}stdout_inline=2\nstderr_inline=2\n\nabcd"),
    ] {
        assert!(
            RunOutcome::parse(&reply(0, bad.as_bytes())).is_err(),
            "{bad:?}"
        );
    }
}

#[test]
fn output_chunk_length_must_match() {
    let mut bytes = format!(
        "waymark-wrap/1 output\nid={ID}\nstream=stderr\nsize=10\noffset=4\nlength=3\nfinished=1\n\n"
    )
    .into_bytes();
    bytes.extend_from_slice(b"\0\n\xff");
    let c = OutputChunk::parse(&reply(0, &bytes)).unwrap();
    assert_eq!(c.data, b"\0\n\xff");
    assert_eq!(c.next_offset(), 7);
    assert!(!c.is_last());
    bytes.pop();
    assert!(OutputChunk::parse(&reply(0, &bytes)).is_err());
}

#[test]
fn a_served_output_chunk_ends_at_its_boundary_and_may_be_short_never_long() {
    let head = |length: usize| {
        format!(
            "waymark-wrap/1 output\nid={ID}\nstream=stdout\nsize=10\noffset=0\nlength={length}\n\
             finished=0\nboundary=0123456789abcdef\n\n"
        )
        .into_bytes()
    };
    let with = |length: usize, data: &[u8], end: &[u8]| {
        let mut b = head(length);
        b.extend_from_slice(data);
        b.extend_from_slice(end);
        OutputChunk::parse(&reply(0, &b))
    };
    let end = b"\n--0123456789abcdef\n";
    assert_eq!(with(3, b"a\nb", end).unwrap().data, b"a\nb");
    // The stream was cut while the host read it: fewer bytes, what it then held.
    assert_eq!(with(3, b"a", end).unwrap().data, b"a");
    assert_eq!(with(3, b"", end).unwrap().data, b"");
    // More than promised, or no boundary line at the end: refused.
    assert!(with(3, b"abcd", end).is_err());
    assert!(with(3, b"abc", b"\n--0123456789abcdee\n").is_err());
    assert!(with(3, b"abc", b"").is_err());
}

#[test]
fn refusals_and_gc_and_install_replies() {
    let status = format!("waymark-wrap/1 status\nid={ID}\nstate=running\n\n");
    match StartOutcome::parse(&reply(65, status.as_bytes())).unwrap() {
        StartOutcome::Refused(r) => assert_eq!(r.existing.state, MarkerState::Running),
        other => panic!("{other:?}"),
    }
    let gc = format!("waymark-wrap/1 gc\nremoved={ID}\n\n");
    assert_eq!(
        GcReport::parse(&reply(0, gc.as_bytes())).unwrap().removed,
        vec![ID.to_owned()]
    );
    assert!(GcReport::parse(&reply(0, b"waymark-wrap/1 gc\n\n"))
        .unwrap()
        .removed
        .is_empty());
    assert!(GcReport::parse(&reply(0, b"waymark-wrap/1 gc\nremoved=x\n\n")).is_err());
    assert_eq!(
        InstallOutcome::parse(&reply(0, b"waymark-install/1 present /h/w\n")).unwrap(),
        InstallOutcome::AlreadyPresent {
            path: "/h/w".into()
        }
    );
    assert!(matches!(
        InstallOutcome::parse(&reply(74, b"")),
        Err(WrapperError::InstallHashMismatch { .. })
    ));
}

#[test]
fn wrapper_name_carries_the_script_hash() {
    assert_eq!(wrapper_name().len(), "wrap-".len() + 16);
    assert!(wrapper_sha256().starts_with(&wrapper_name()[5..]));
}
