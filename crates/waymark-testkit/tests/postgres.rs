//! The PostgreSQL test cluster: a real server, reachable on loopback, one database per test,
//! gone when the process that started it is.

use std::time::{Duration, Instant};

use waymark_testkit::{output_within, TestPostgres};

fn psql(pg: &TestPostgres, db: &str, sql: &str) -> String {
    let out = output_within(pg.psql(db).args(["-c", sql]), Duration::from_secs(30));
    assert!(
        out.status.success(),
        "psql failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).trim().to_string()
}

#[test]
fn shared_cluster_gives_each_test_its_own_database_on_loopback() {
    let pg = TestPostgres::shared();
    let a = pg.create_database("first");
    let b = pg.create_database("first");
    assert_ne!(a, b, "two databases with the same hint must differ");
    assert!(a.starts_with("postgresql://waymark@127.0.0.1:"), "{a}");
    let name_a = a.rsplit('/').next().unwrap();
    let name_b = b.rsplit('/').next().unwrap();
    psql(
        pg,
        name_a,
        "create table t (x int); insert into t values (7)",
    );
    assert_eq!(psql(pg, name_a, "select x from t"), "7");
    // The second database does not see the first one's table.
    let out = output_within(
        pg.psql(name_b).args(["-c", "select x from t"]),
        Duration::from_secs(30),
    );
    assert!(!out.status.success(), "table leaked across databases");
    assert_eq!(psql(pg, name_a, "show listen_addresses"), "127.0.0.1");
    // PostgreSQL refuses root, so as root it runs as an unprivileged user.
    assert_ne!(
        psql(pg, name_a, "select current_setting('data_directory')"),
        ""
    );
}

#[test]
fn a_cluster_stops_when_dropped_and_when_its_process_is_killed() {
    let pg = TestPostgres::start();
    let port = pg.port();
    drop(pg);
    assert!(
        std::net::TcpStream::connect(("127.0.0.1", port)).is_err(),
        "port {port} still accepts after drop"
    );

    // A child test process that starts a cluster and is SIGKILLed: the watchdog stops it.
    let exe = std::env::current_exe().unwrap();
    let mut child = std::process::Command::new(exe)
        .args([
            "--exact",
            "child_starts_a_cluster_and_waits",
            "--nocapture",
            "--ignored",
        ])
        .env("WAYMARK_PG_CHILD", "1")
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut out = std::io::BufReader::new(child.stdout.take().unwrap());
    let mut line = String::new();
    let port: u16 = loop {
        line.clear();
        assert!(
            std::io::BufRead::read_line(&mut out, &mut line).unwrap() > 0,
            "child ended before printing its port"
        );
        if let Some(p) = line.trim().strip_prefix("PORT=") {
            break p.parse().unwrap();
        }
    };
    assert!(std::net::TcpStream::connect(("127.0.0.1", port)).is_ok());
    child.kill().unwrap();
    child.wait().unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_ok() {
        assert!(
            Instant::now() < deadline,
            "the cluster of a killed process still listens on {port}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[test]
#[ignore = "run by a_cluster_stops_when_dropped_and_when_its_process_is_killed"]
fn child_starts_a_cluster_and_waits() {
    if std::env::var_os("WAYMARK_PG_CHILD").is_none() {
        return;
    }
    let pg = TestPostgres::shared();
    println!("PORT={}", pg.port());
    std::thread::sleep(Duration::from_secs(120));
}
