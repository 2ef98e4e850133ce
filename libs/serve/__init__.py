"""Serve mode: the rollout-worker's engine behind an OpenAI-compatible HTTP API.

- `config`: `ServeConfig`, where it listens, its keys and every bound;
- `protocol`: the request bodies (the OpenAI subset, plus vLLM's extras) and `ApiError`;
- `choice`: constrained choice (vLLM's `guided_choice`): pick among strings by their
  sequence probability under the model;
- `generation`: `ServedPolicy`, HTTP-free: prompt ids in, sampled or chosen completions out,
  each recorded as a `ServedGeneration`;
- `holds`: a request decoded in short holds of the engine, so rollouts and weight swaps
  never wait long behind it;
- `admission`: how many requests generate and wait, what one key holds (429 beyond);
- `records`: `GenerationRecorder`, the records to the generations stream;
- `responses`: OpenAI response bodies (chat and legacy logprobs formats);
- `app`: the FastAPI app (`/v1/models`, `/v1/chat/completions`, `/v1/completions`);
- `server`: uvicorn inside the service's own event loop.
"""
