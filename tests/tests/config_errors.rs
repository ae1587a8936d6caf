//! Bad configuration and bad certificates make the real binaries exit with a message that
//! names what is wrong.

use std::process::Command;

use tether_test_support::{Pki, bin};
use tether_tls::Identity;

fn run(binary: &str, config: &str, dir: &std::path::Path) -> anyhow::Result<(bool, String)> {
    let path = dir.join(format!("{binary}-{:x}.yaml", rand::random::<u32>()));
    std::fs::write(&path, config)?;
    let out = Command::new(bin(binary)?)
        .arg("--config")
        .arg(&path)
        .output()?;
    Ok((
        out.status.success(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    ))
}

struct Setup {
    dir: tempfile::TempDir,
    tls: String,
}

fn setup() -> anyhow::Result<Setup> {
    tether_tls::install_default_crypto()?;
    let dir = tempfile::tempdir()?;
    let pki = Pki::new(dir.path())?;
    let leaf = pki.issue("b", Identity::Broker { id: "b".into() }, &["localhost"])?;
    let tls = format!(
        "tls:\n  cert: {}\n  key: {}\n  ca: {}\n",
        leaf.cert.display(),
        leaf.key.display(),
        leaf.ca.display()
    );
    Ok(Setup { dir, tls })
}

const BROKER_BASE: &str =
    "id: b\nagent_listen: 127.0.0.1:0\nclient_listen: 127.0.0.1:0\nadmin_listen: 127.0.0.1:0\n";

#[test]
fn broker_config_errors_name_the_field() -> anyhow::Result<()> {
    let s = setup()?;
    let cases: &[(&str, &str)] = &[
        ("tunnel:\n  max_frame_bytes: 10\n", "tunnel.max_frame_bytes"),
        (
            "tunnel:\n  tls_send_buffer_bytes: 100\n",
            "tunnel.tls_send_buffer_bytes",
        ),
        (
            "tunnel:\n  tcp_notsent_lowat_bytes: 100\n",
            "tunnel.tcp_notsent_lowat_bytes",
        ),
        ("tunnel:\n  stream_windw_bytes: 10\n", "stream_windw_bytes"),
        ("dial_timeout: soon\n", "dial_timeout"),
        (
            "clients:\n  - name: a\n    token_sha256: xyz\n",
            "clients[0].token_sha256",
        ),
        (
            "clients:\n  - name: a\n    allow:\n      - clusters: ['*']\n        targets: ['a*b:1']\n",
            "clients[0].allow[0].targets[0]",
        ),
    ];
    for (extra, field) in cases {
        let (ok, stderr) = run(
            "tunnel-broker",
            &format!("{BROKER_BASE}{}{extra}", s.tls),
            s.dir.path(),
        )?;
        assert!(!ok, "config with {extra:?} was accepted");
        assert!(
            stderr.contains(field),
            "error for {extra:?} does not name {field}: {stderr}"
        );
    }
    // Missing listeners.
    let (ok, stderr) = run(
        "tunnel-broker",
        &format!("id: b\nagent_listen: 127.0.0.1:0\n{}", s.tls),
        s.dir.path(),
    )?;
    assert!(!ok && stderr.contains("client_listen"), "{stderr}");
    Ok(())
}

#[test]
fn bad_certificate_files_are_named() -> anyhow::Result<()> {
    let s = setup()?;
    let garbage = s.dir.path().join("garbage.crt");
    std::fs::write(&garbage, "not a certificate")?;
    let tls = format!(
        "tls:\n  cert: {}\n  key: {}\n  ca: {}\n",
        garbage.display(),
        s.dir.path().join("b.key").display(),
        s.dir.path().join("ca.crt").display()
    );
    let (ok, stderr) = run(
        "tunnel-broker",
        &format!("{BROKER_BASE}{tls}"),
        s.dir.path(),
    )?;
    assert!(!ok);
    assert!(
        stderr.contains("garbage.crt") && stderr.contains("CERTIFICATE"),
        "{stderr}"
    );

    // A key that does not belong to the certificate.
    let other = Pki::new(&s.dir.path().join("other"))?;
    let o = other.issue("x", Identity::Broker { id: "x".into() }, &["localhost"])?;
    let tls = format!(
        "tls:\n  cert: {}\n  key: {}\n  ca: {}\n",
        s.dir.path().join("b.crt").display(),
        o.key.display(),
        s.dir.path().join("ca.crt").display()
    );
    let (ok, stderr) = run(
        "tunnel-broker",
        &format!("{BROKER_BASE}{tls}"),
        s.dir.path(),
    )?;
    assert!(!ok);
    assert!(stderr.contains("does not match key"), "{stderr}");
    Ok(())
}

#[test]
fn agent_config_errors_name_the_field() -> anyhow::Result<()> {
    let s = setup()?;
    let base = format!(
        "{}brokers:\n  - addresses: ['127.0.0.1:1']\n    server_name: localhost\n",
        s.tls
    );
    let cases: &[(&str, &str)] = &[
        ("cluster: Bad_Name\n", "cluster"),
        ("cluster: c1\napiserver: nohostport\n", "apiserver"),
        ("cluster: c1\npolicy:\n  deny: ['*:x']\n", "policy.deny[0]"),
        (
            "cluster: c1\nbackoff:\n  initial: 1 parsec\n",
            "backoff.initial",
        ),
    ];
    for (extra, field) in cases {
        let (ok, stderr) = run("tunnel-agent", &format!("{base}{extra}"), s.dir.path())?;
        assert!(!ok, "config with {extra:?} was accepted");
        assert!(
            stderr.contains(field),
            "error for {extra:?} does not name {field}: {stderr}"
        );
    }
    let (ok, stderr) = run(
        "tunnel-agent",
        &format!(
            "{}cluster: c1\nbrokers:\n  - addresses: ['nope']\n    server_name: x\n",
            s.tls
        ),
        s.dir.path(),
    )?;
    assert!(
        !ok && stderr.contains("brokers[0].addresses[0]"),
        "{stderr}"
    );
    Ok(())
}

/// `TETHER_TLS_AEAD` (tether_tls::provider) with a value no library answers to stops every
/// binary before it does anything, naming the variable, the value and the accepted ones.
#[test]
fn an_unknown_tls_aead_is_named() -> anyhow::Result<()> {
    let s = setup()?;
    let path = s.dir.path().join("broker-aead.yaml");
    std::fs::write(&path, format!("{BROKER_BASE}{}", s.tls))?;
    // With the check gone the broker would serve this valid config: bound the wait (the
    // child is stopped when dropped).
    let mut cmd = Command::new(bin("tunnel-broker")?);
    cmd.arg("--config")
        .arg(&path)
        .env("TETHER_TLS_AEAD", "openssl");
    let mut broker = tether_test_support::Child::spawn("tunnel-broker", cmd, s.dir.path())?;
    let broker_status = broker.wait_exit(std::time::Duration::from_secs(30))?;
    let broker_stderr = std::fs::read_to_string(broker.log_path())?;
    let tetherctl = Command::new(bin("tetherctl")?)
        .arg("--help")
        .env("TETHER_TLS_AEAD", "openssl")
        .output()?;
    let tetherctl_stderr = String::from_utf8_lossy(&tetherctl.stderr);
    for (name, status, stderr) in [
        ("tunnel-broker", broker_status, broker_stderr.as_str()),
        ("tetherctl", tetherctl.status, &*tetherctl_stderr),
    ] {
        assert!(!status.success(), "{name} accepted TETHER_TLS_AEAD=openssl");
        assert!(
            stderr.contains("TETHER_TLS_AEAD=\"openssl\"")
                && stderr.contains("aws-lc-rs")
                && stderr.contains("ring"),
            "{name}: {stderr}"
        );
    }
    Ok(())
}
