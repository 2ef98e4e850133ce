"""Serve mode: the rollout-worker's engine behind an OpenAI-compatible HTTP API.

- `protocol`: the request bodies (the OpenAI subset, plus vLLM's extras) and `ApiError`;
- `choice`: constrained choice (vLLM's `guided_choice`): pick among strings by their
  sequence probability under the model;
- `policy`: `ServedPolicy`, HTTP-free: prompt ids in, sampled or chosen completions out,
  each recorded as a `ServedGeneration`;
- `records`: `GenerationRecorder`, the records to the generations stream;
- `responses`: OpenAI response bodies (chat and legacy logprobs formats);
- `app`: the FastAPI app (`/v1/models`, `/v1/chat/completions`, `/v1/completions`);
- `server`: uvicorn inside the service's own event loop.
"""
