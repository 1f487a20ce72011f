//! https to the gateway: rustls (ring provider) through ureq. The roots are Mozilla's
//! (webpki-roots, built in: nothing read from the host) unless `[offsite] ca_file` names a PEM
//! bundle, whose certificates are then the only roots (as `aws --ca-bundle` or `curl --cacert`
//! do): a Ceph cluster with a private CA, or the system's bundle
//! (`/etc/ssl/certs/ca-certificates.crt`). webpki-roots holds trust anchors, not certificates,
//! so a private CA cannot be added beside them without another crate: replacing is the rule.
//! The bundle is read and checked when the config is loaded, so a bad one stops the daemon
//! before anything starts.
//!
//! A TLS failure (unknown CA, a certificate for another name, an expired one) is an
//! `S3Error::Tls` saying so, which the uploader and the pull report as
//! `ERR_OFFSITE_UNREACHABLE` like any other failure to reach the store.

use std::path::Path;

use ureq::tls::{Certificate, PemItem, RootCerts, TlsConfig};

/// Reads a PEM bundle of CA certificates: an error (one line) if it cannot be read, is not
/// PEM, or holds no certificate.
pub fn read_ca_file(path: &Path) -> Result<Vec<Certificate<'static>>, String> {
    let bytes = std::fs::read(path).map_err(|e| format!("{}: {e}", path.display()))?;
    let mut certs = Vec::new();
    for item in ureq::tls::parse_pem(&bytes) {
        match item {
            Ok(PemItem::Certificate(c)) => certs.push(c),
            // A private key beside the CA certificate: not ours to use, not an error.
            Ok(_) => {}
            Err(e) => return Err(format!("{}: not a PEM file: {e}", path.display())),
        }
    }
    // A DER body that is not an X.509 SEQUENCE would be skipped silently by rustls' root store.
    if let Some(bad) = certs.iter().position(|c| c.der().first() != Some(&0x30)) {
        return Err(format!(
            "{}: certificate {} is not DER X.509",
            path.display(),
            bad + 1
        ));
    }
    if certs.is_empty() {
        return Err(format!(
            "{}: no PEM certificate (-----BEGIN CERTIFICATE-----) in it",
            path.display()
        ));
    }
    Ok(certs)
}

/// ureq's TLS settings for these roots (empty: the built-in Mozilla roots).
pub fn tls_config(ca_certs: &[Certificate<'static>]) -> TlsConfig {
    let roots = if ca_certs.is_empty() {
        RootCerts::WebPki
    } else {
        RootCerts::new_with_certs(ca_certs)
    };
    TlsConfig::builder().root_certs(roots).build()
}

/// The host part of `http://host:port` / `https://[::1]:port`.
fn endpoint_host(endpoint: &str) -> &str {
    let rest = endpoint.split_once("://").map_or(endpoint, |(_, r)| r);
    let authority = rest.split('/').next().unwrap_or(rest);
    if let Some(v6) = authority.strip_prefix('[') {
        return v6.split(']').next().unwrap_or(v6);
    }
    authority.rsplit_once(':').map_or(authority, |(h, _)| h)
}

/// True for plain http to anything but this machine: object bytes (guest RAM, disks) cross the
/// network in clear. The credentials never do (SigV4 sends a signature, not the secret).
pub fn is_cleartext_to_network(endpoint: &str) -> bool {
    if !endpoint.starts_with("http://") {
        return false;
    }
    let host = endpoint_host(endpoint);
    let loopback = host == "localhost"
        || host
            .parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.is_loopback());
    !loopback
}

/// Logged once when replication starts.
pub fn warn_if_cleartext(endpoint: &str) {
    if is_cleartext_to_network(endpoint) {
        tracing::warn!(endpoint,
            "offsite endpoint is plain http to another host: snapshot bytes cross the network unencrypted (requests are signed, the secret key is not sent); use https://");
    }
}

/// A ureq error's TLS reason, if the failure was the TLS handshake.
pub fn tls_reason(e: &ureq::Error) -> Option<String> {
    match e {
        ureq::Error::Rustls(r) => Some(r.to_string()),
        ureq::Error::Tls(r) => Some((*r).to_string()),
        ureq::Error::Io(io) => {
            // rustls reports a handshake failure through the stream as an io error wrapping
            // its own error.
            // Only a custom error carries one (an OS error such as "connection reset by peer"
            // has no inner error).
            let text = io.get_ref()?.to_string();
            [
                "certificate",
                "received fatal alert",
                "peer is incompatible",
                "peer misbehaved",
                "handshake",
            ]
            .iter()
            .any(|k| text.contains(k))
            .then_some(text)
        }
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use std::io::Write;

    use super::*;

    #[test]
    fn plain_http_is_flagged_only_off_this_machine() {
        assert!(!is_cleartext_to_network("http://127.0.0.1:7480"));
        assert!(!is_cleartext_to_network("http://localhost:7480"));
        assert!(!is_cleartext_to_network("http://[::1]:7480"));
        assert!(is_cleartext_to_network("http://rgw.example:7480"));
        assert!(is_cleartext_to_network("http://10.0.0.5"));
        assert!(!is_cleartext_to_network("https://rgw.example"));
    }

    #[test]
    fn the_system_bundle_is_a_valid_ca_file() {
        // Debian's bundle (update-ca-certificates adds a private CA to it).
        let system = Path::new("/etc/ssl/certs/ca-certificates.crt");
        if !system.exists() {
            eprintln!("SKIPPED: no {}", system.display());
            return;
        }
        assert!(read_ca_file(system).unwrap().len() > 50);
    }

    #[test]
    fn a_ca_file_must_hold_a_certificate() {
        let missing = read_ca_file(Path::new("/nonexistent/ca.pem")).unwrap_err();
        assert!(missing.contains("/nonexistent/ca.pem"), "{missing}");

        let mut f = tempfile::NamedTempFile::new().unwrap();
        writeln!(f, "not a certificate").unwrap();
        let e = read_ca_file(f.path()).unwrap_err();
        assert!(e.contains("no PEM certificate"), "{e}");

        let mut k = tempfile::NamedTempFile::new().unwrap();
        writeln!(
            k,
            "-----BEGIN PRIVATE KEY-----\nMC4CAQAwBQYDK2VwBCIEIJ+DYvh6SEqVTm50DFtMDoQikTmiCqirVv9mWG9qfSnF\n-----END PRIVATE KEY-----"
        )
        .unwrap();
        let e = read_ca_file(k.path()).unwrap_err();
        assert!(e.contains("no PEM certificate"), "{e}");

        let mut b = tempfile::NamedTempFile::new().unwrap();
        writeln!(
            b,
            "-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----"
        )
        .unwrap();
        let e = read_ca_file(b.path()).unwrap_err();
        assert!(e.contains("not DER X.509"), "{e}");
    }
}
