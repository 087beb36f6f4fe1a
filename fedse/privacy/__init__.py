"""What keeps an organisation's adapter private: secure aggregation's arithmetic and protocol
messages (secagg), its key agreement, secret sharing and masks (masking), the fixed-point ring its
sums live in (fixedpoint), and differential-privacy accounting of what is published (accounting)."""
