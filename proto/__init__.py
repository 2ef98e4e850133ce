"""The wire contract of rlpipe: subjects, streams, consumers and message schemas.

This package depends on msgspec alone, so any process can import it; other languages use
the JSON Schema that `make schema` writes to `proto/schema/`.
"""
