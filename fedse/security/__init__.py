"""Who may join and who said what: admission by mTLS and tokens (admission), the federation's
certificates made offline (certs), TLS files renewed in place (tls_files), the member list
(members) and signatures that bind secure aggregation's messages to a certificate (signatures)."""
