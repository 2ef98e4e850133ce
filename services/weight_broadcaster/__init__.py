"""The weight-broadcaster service: encodes, stores and announces weight versions."""
