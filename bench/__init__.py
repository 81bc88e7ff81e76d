"""Benchmarks. `bench.serve` is `tessera bench serve`, a load client for any OpenAI-compatible
server; the other modules here are standalone scripts that print numbers (not tests)."""
