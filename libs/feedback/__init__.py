"""Product feedback over HTTP, joined with the generations it rates.

- `api`: the FastAPI app (POST /v1/feedback, POST /v1/feedback:batch, /healthz, /metrics);
- `auth`: API keys per product, stored as SHA-256 hashes;
- `rate_limit`: a token bucket per API key;
- `validation`: JSON bodies to proto `FeedbackEvent`s, with every failing field named;
- `server`: uvicorn inside the service's own event loop;
- `join`: feedback events matched with served generations into `OnlineSample`s.
"""
