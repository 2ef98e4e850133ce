"""The env-gateway service: serves environments (reset/step/close) over request/reply."""
