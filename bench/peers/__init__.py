"""Peer systems the benchmark compares against: Redis Streams and PostgreSQL."""
